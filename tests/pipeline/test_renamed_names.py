"""The pipeline's engine was ``PipelineTrainer``/``build_trainer`` before issue 47 (names shipped in the
package README): they still import, as the new objects, with a DeprecationWarning naming the new name."""

from __future__ import annotations

import pytest

import deepshard.pipeline as pipeline


@pytest.mark.parametrize(("old", "new"), [("PipelineTrainer", "PipelineEngine"), ("build_trainer", "build_engine")])
def test_old_names_warn_and_resolve_to_the_new(old, new):
    with pytest.warns(DeprecationWarning, match=f"use deepshard.pipeline.{new}"):
        assert getattr(pipeline, old) is getattr(pipeline, new)


def test_unknown_names_still_raise():
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        pipeline.Trainer  # noqa: B018

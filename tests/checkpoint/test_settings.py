"""checkpoint.* settings: on_error is stop (default) or continue; anything else names the key."""

from __future__ import annotations

import pytest

from deepshard.finetune.config.settings import validate_checkpoint


def test_on_error_defaults_to_stop_and_accepts_continue():
    assert validate_checkpoint({}).on_error == "stop"
    assert validate_checkpoint({"on_error": "continue"}).on_error == "continue"


def test_a_bad_on_error_names_the_key_and_the_valid_values():
    with pytest.raises(ValueError, match=r"checkpoint\.on_error='ignore': valid values are 'stop' and 'continue'"):
        validate_checkpoint({"on_error": "ignore"})

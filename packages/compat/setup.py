"""Only what pyproject.toml cannot say: install ``deepshard_deepspeed.pth`` into site-packages.

The .pth imports ``deepshard.compat.provide_deepspeed`` at interpreter start when ``DEEPSHARD_DEEPSPEED``
is set (the ``deepshard`` launcher sets it in its workers); unset, it costs one dict lookup.  A wheel
puts a data file under its installation prefix, so the path is site-packages relative to the prefix
of the interpreter that builds (pip builds with the target's own interpreter).  setuptools' editable
wheel skips data files (its ``_run_install("data")`` asks for ``has_data``, which Distribution does
not have; it has ``has_data_files``): the subclass below installs them, as a regular wheel does."""

import os
import sys
import sysconfig

from setuptools import setup
from setuptools.command.editable_wheel import editable_wheel


class EditableWheelWithData(editable_wheel):
    def _run_install(self, category: str) -> None:
        super()._run_install(category)
        if category == "data" and not hasattr(self.distribution, "has_data") and self.distribution.has_data_files():
            self.run_command("install_data")


site = os.path.relpath(sysconfig.get_paths()["purelib"], sys.prefix)
setup(data_files=[(site, ["src/deepshard_deepspeed.pth"])], cmdclass={"editable_wheel": EditableWheelWithData})

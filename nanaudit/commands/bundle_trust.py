"""What `nanaudit replay` imports without asking: a bundle is data, but its config.yaml and
meta.json name code (the model factory, the loss, classes), and a replay imports and calls it.
Edited by a stranger, `model: os:system` would run a shell command.

So every module a replay is about to import is vetted first, before any of its code runs. It is
imported when it lies in the bundle itself, in the working folder (your project), in a package
installed in this environment (a distribution: torch, transformers, your own `pip install -e
.`), on the import path you set yourself (PYTHONPATH), or in the folder of the config the
bundle was written from when that config is here and unchanged (your own bundle); the targets
typed on the command line (`--model`, `--loss`) are yours. Anything else (the standard
library's `os`, `subprocess`, a file in some other folder the bundle points at) is refused with
a usage error (exit 2) unless `--trust-entrypoints` says the bundle's author is trusted.
Installed packages are trusted whole: a bundle can still call any function of theirs, which
the README says.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import sys
from collections.abc import Iterable
from pathlib import Path

from nanaudit.commands.bundle import Bundle
from nanaudit.config.schema import Entrypoint
from nanaudit.errors import UsageError


class EntrypointGate:
    """Called by the config stage before it imports an entrypoint's module (see the module
    docstring); raises UsageError to refuse. Build it before the bundle's folders are put on
    the import path: the path as it is then is yours."""

    def __init__(self, bundle: Bundle, typed: Iterable[str | None] = ()):
        self.trusted_folders = [bundle.folder.resolve(), Path.cwd().resolve()]
        mine = own_config_folder(bundle)
        if mine is not None:
            self.trusted_folders.append(mine)
        self.own_path = set(sys.path)
        self.typed = {t for t in typed if t}
        self._installed: set[str] | None = None

    def __call__(self, entry: Entrypoint, base_dir: Path) -> None:
        if entry.target in self.typed:
            return
        module = entry.module_part
        if module.endswith(".py") or "/" in module or "\\" in module:
            path = Path(module).expanduser()
            where = (path if path.is_absolute() else base_dir / path).resolve()
            if not self._inside(where):
                self._refuse(entry, f"the file {where}")
            return
        top = module.split(".")[0]
        if top in sys.stdlib_module_names:
            self._refuse(entry, f"`{top}`, a module of Python's standard library")
        if top in sys.modules or top in self._installed_names():
            return
        for folder in sys.path:      # the import's own order: the first folder holding it wins
            spec = importlib.machinery.PathFinder.find_spec(top, [folder])
            if spec is None:
                continue
            origin = Path(spec.origin or folder or ".").resolve()
            if folder not in self.own_path and not self._inside(origin):
                self._refuse(entry, f"`{top}` from {Path(folder or '.').resolve()}")
            return
        # Found nowhere: the import fails as usual (a config error), running nothing.

    def _inside(self, path: Path) -> bool:
        return any(path == folder or folder in path.parents for folder in self.trusted_folders)

    def _installed_names(self) -> set[str]:
        if self._installed is None:
            self._installed = set(importlib.metadata.packages_distributions())
        return self._installed

    def _refuse(self, entry: Entrypoint, what: str) -> None:
        raise UsageError(
            f"not replayed: the bundle's {entry.key} names `{entry.target}`, which is {what}: "
            f"neither in the bundle, nor in this folder, nor an installed package. A replay "
            f"imports and calls what the bundle names, so an edited bundle could run any code; "
            f"pass --trust-entrypoints if you trust whoever wrote this bundle")


def own_config_folder(bundle: Bundle) -> Path | None:
    """The folder of the config a `scan` bundle was written from, when that config is on this
    machine and reads as the bundle's copy: replaying runs what scanning it again would."""
    recorded = bundle.meta.get("config_path")
    if not isinstance(recorded, str):
        return None
    try:
        same = Path(recorded).read_bytes() == (bundle.folder / "config.yaml").read_bytes()
    except OSError:
        return None
    return Path(recorded).resolve().parent if same else None

"""Installs gpumem as soon as torch is imported, in programs that never import gpumem themselves.

site-packages/gpumem-autoload.pth runs at every interpreter start-up and imports this module only
when GPUMEM_LIMIT, GPUMEM_SHARE or GPUMEM_FLOOR is set (VARIABLES; gpumem._autoload.ARMING);
without them the start-up costs three dictionary lookups. This module must stay small and import
neither torch nor gpumem: with a variable set it loads into every Python process, most of which
never touch torch. `hook()` puts a finder first on sys.meta_path that lets torch import as usual
and, right after torch's own __init__ has run (so before the program can allocate CUDA memory),
hands over to gpumem._autoload, which checks the variables and installs gpumem (GPUMEM_SHARE=off
alone installs nothing). `python -S` skips .pth files, and with them this hook.
"""
import os
import sys

VARIABLES = ("GPUMEM_LIMIT", "GPUMEM_SHARE", "GPUMEM_FLOOR")


class _TorchFinder:
    """Finds nothing itself: it wraps the loader that another finder returns for `torch`."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = _find_elsewhere(self, name, path, target)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenInstallGpumem(spec.loader)
        return spec


class _ThenInstallGpumem:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # torch sees its own loader, never this wrapper.
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        _install_gpumem()
        _finder_off()  # only once installed: a failed install exits, and a retried import retries


_finder = _TorchFinder()


def hook():
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _finder_off():
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def _find_elsewhere(finder, name, path, target):
    for other in sys.meta_path:
        find_spec = getattr(other, "find_spec", None)
        spec = None if other is finder or find_spec is None else find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


def _install_gpumem():
    try:
        from gpumem import _autoload
    except ImportError as error:
        named = " and ".join(variable for variable in VARIABLES if variable in os.environ)
        sys.stderr.write(f"gpumem: {named} is set but gpumem cannot be imported ({error}); the "
                         "program stops rather than run without what it asked for. Reinstall gpumem or "
                         f"unset {named}.\n")
        raise SystemExit(2) from None
    _autoload.install()

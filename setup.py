"""Builds gpumem._C: the core, the CUDA backend, the torch adapter and the pybind11 module.

Needs PyTorch already installed and no nvcc (only the CUDA runtime's headers and library):
    pip install --no-build-isolation .      (or -e . for a working copy)

The version is VERSION plus a local label naming the torch the build is for (0.1.0+torch2.11.0.cu130),
and the build leaves gpumem/_build.py beside _C to say the same to gpumem/__init__.py, which
refuses to load _C under another torch (see python/gpumem/_build_check.py).

The torch adapter has to match the installed torch's CUDAAllocator interface, which changes
between releases. torch_feature_macros() reads the installed headers and says which of the known
changes are present; csrc/torch/compat.h turns the answers into code. CMake's torch tests call
the same function, so both builds see one list.
"""
import glob
import os
import re

VERSION = "0.1.0"  # the public version, the one place it is written

# (macro, header under torch/include, pattern searched in that header with all white space removed)
TORCH_FEATURES = [
    ("DEVICE_ALLOCATOR_BASE", "c10/cuda/CUDACachingAllocator.h", r"classCUDAAllocator:publicDeviceAllocator"),
    ("SHARE_IPC_HANDLE", "c10/cuda/CUDACachingAllocator.h", r"virtualShareableHandleshareIpcHandle\("),
    ("ENABLE", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidenable\(bool"),
    ("GET_MEMORY_FRACTION", "c10/cuda/CUDACachingAllocator.h", r"virtualdoublegetMemoryFraction\("),
    ("EMPTY_CACHE_POOL", "*", r"voidemptyCache\(MempoolId_t"),
    ("SNAPSHOT_POOL", "c10/cuda/CUDACachingAllocator.h", r"SnapshotInfosnapshot\(MempoolId_t"),
    ("TRACE_ENTRY_POOL", "*", r"stream,MempoolId_tmempool,approx_time_ttime"),
    ("INCLUDE_TRACES", "c10/cuda/CUDACachingAllocator.h", r"boolinclude_traces"),
    ("CLEAR_HISTORY", "c10/cuda/CUDACachingAllocator.h", r"recordHistory\([^)]*boolclearHistory"),
    ("SKIP_ACTIONS", "c10/cuda/CUDACachingAllocator.h", r"recordHistory\([^)]*skip_actions"),
    ("EXPANDABLE_SEGMENT_SIZES", "c10/cuda/CUDACachingAllocator.h", r"virtualstd::vector<StreamSegmentSize>getExpandableSegmentSizes"),
    ("ENSURE_EXISTS_AND_INCREF_POOL", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidensureExistsAndIncrefPool\("),
    ("CREATE_OR_INCREF_POOL", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidcreateOrIncrefPool"),
    ("POOL_ALLOCATOR_SHARED_PTR", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidcreateOrIncrefPool\([^)]*std::shared_ptr<CUDAAllocator>"),
    ("POOL_USE_COUNT", "c10/cuda/CUDACachingAllocator.h", r"virtualintgetPoolUseCount"),
    ("SET_USE_ON_OOM", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidsetUseOnOOM"),
    ("SET_USE_ON_OOM_FLAG", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidsetUseOnOOM\([^)]*booluse_on_oom"),
    ("SET_NO_SPLIT", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidsetNoSplit"),
    ("OOM_REJECTION_OBSERVER", "c10/cuda/CUDACachingAllocator.h", r"attachOomRejectionObserver"),
    ("GET_MEMORY_INFO", "*", r"std::pair<size_t,size_t>getMemoryInfo\("),
    ("IS_SIMPLE_DATA_PTR", "c10/core/Allocator.h", r"virtualboolis_simple_data_ptr"),
    ("COMPILE_CONTEXT", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidpushCompileContext\("),
    ("USER_METADATA", "c10/cuda/CUDACachingAllocator.h", r"virtualvoidsetUserMetadata\("),
    ("TRACE_ENTRY_COMPILE_CONTEXT", "*", r"std::stringcompile_context_;"),
    ("TRACE_ENTRY_USER_METADATA", "*", r"std::stringuser_metadata_;"),
    ("ROUNDUP_DIVISIONS", "c10/core/AllocatorConfig.h", r"staticsize_troundup_power2_divisions\(size_tsize\)"),
    ("ROUNDUP_DIVISIONS_TABLE", "c10/core/AllocatorConfig.h",
     r"staticconststd::vector<size_t>&roundup_power2_divisions\(\)"),
    # Before the setting moved to c10/core (2.6 to 2.8 at least): CUDAAllocatorConfig's own lookup.
    ("CUDA_ROUNDUP_DIVISIONS", "c10/cuda/CUDAAllocatorConfig.h", r"staticsize_troundup_power2_divisions\(size_tsize\)"),
    ("CAPTURE_RECORD_STREAM_REUSE", "c10/cuda/CUDAAllocatorConfig.h", r"staticboolgraph_capture_record_stream_reuse\(\)"),
    ("FRACTION_SETTING", "c10/cuda/CUDAAllocatorConfig.h", r"staticdoubleper_process_memory_fraction\(\)"),
]
ALLOCATOR_HEADERS = ["c10/cuda/CUDACachingAllocator.h", "c10/core/CachingDeviceAllocator.h"]


def torch_include_dir():
    import torch
    return os.path.join(os.path.dirname(torch.__file__), "include")


def torch_feature_macros(include_dir=None):
    """-D flags (without the -D) saying which interface changes the installed torch has."""
    include_dir = include_dir or torch_include_dir()

    def text(header):
        path = os.path.join(include_dir, header)
        return re.sub(r"\s+", "", open(path).read()) if os.path.exists(path) else ""

    macros = []
    for name, header, pattern in TORCH_FEATURES:
        haystack = "".join(text(h) for h in (ALLOCATOR_HEADERS if header == "*" else [header]))
        macros.append(f"GPUMEM_TORCH_HAS_{name}={int(re.search(pattern, haystack) is not None)}")
    # The release's minor number, for what differs by release with no declaration to find: the
    # version byte of CUDA IPC handles (csrc/torch/ipc_handle.cpp).
    version = text("torch/headeronly/version.h") or text("torch/csrc/api/include/torch/version.h")
    minor = re.search(r"#defineTORCH_VERSION_MINOR(\d+)", version)
    macros.append(f"GPUMEM_TORCH_VERSION_MINOR={int(minor.group(1)) if minor else 0}")
    return macros


def cudart_library():
    """(directory, -l name) of the CUDA runtime torch loads, so gpumem shares it."""
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    for found in sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*"))):
        return os.path.dirname(found), ":" + os.path.basename(found)
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return os.path.join(cuda_home, "lib64"), "cudart"


def _quoted_includes(header):
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(header).read(), re.MULTILINE)


def cuda_include_dirs():
    """The CUDA runtime headers to compile against: those of the runtime torch loads.

    The runtime API changes between CUDA major versions under the same names (cudaDeviceProp's
    layout, the capture calls' parameters, cudaGetDriverEntryPoint), so headers of another major
    than torch's runtime compile but call it wrongly or fail to load (CUDA 13 headers against
    torch 2.6's CUDA 12.4 runtime: undefined symbol cudaGetDriverEntryPointByVersion). The pip
    wheel of torch's runtime ships its API headers beside its library, but not always the crt/
    headers they include (compiler macros): a toolkit at CUDA_HOME (default /usr/local/cuda) comes
    after it for those, and serves alone where the wheel has no headers, only when its major
    version is torch's.
    """
    import torch
    cudart_dir, _ = cudart_library()
    wheel = os.path.join(os.path.dirname(cudart_dir), "include")
    toolkit = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
    candidates = [d for d in (wheel, toolkit) if os.path.exists(os.path.join(d, "cuda_runtime_api.h"))]
    if not candidates:
        raise SystemExit(f"gpumem: no CUDA runtime headers (cuda_runtime_api.h) in {wheel} or {toolkit}; "
                         "install the CUDA toolkit's headers and set CUDA_HOME to it")
    wanted = None if torch.version.cuda is None else int(torch.version.cuda.split(".")[0])
    for api_dir in candidates:
        text = open(os.path.join(api_dir, "cuda_runtime_api.h")).read()
        version = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
        if wanted is not None and not (version and int(version.group(1)) // 1000 == wanted):
            continue
        dirs = [api_dir] + [d for d in (toolkit,) if d != api_dir and os.path.isdir(d)]
        missing = [name for name in _quoted_includes(os.path.join(api_dir, "cuda_runtime_api.h"))
                   if not any(os.path.exists(os.path.join(d, name)) for d in dirs)]
        if missing:
            raise SystemExit(f"gpumem: the CUDA runtime headers in {api_dir} include {', '.join(missing)}, found "
                             f"neither there nor in {toolkit}; set CUDA_HOME to a CUDA toolkit")
        return dirs
    raise SystemExit(f"gpumem: torch {torch.__version__} runs CUDA {torch.version.cuda}'s runtime, but the CUDA "
                     f"headers in {' and '.join(candidates)} are of another major version; set CUDA_HOME to a "
                     f"CUDA {wanted} toolkit, or install the runtime's headers with torch's CUDA runtime wheel")


AUTOLOAD_PTH = "python/gpumem-autoload.pth"


def build_py_with_autoload_pth():
    """build_py, plus gpumem-autoload.pth at the top of site-packages, so that GPUMEM_LIMIT caps
    programs that never import gpumem (see python/_gpumem_autoload.py).

    A wheel installs the top of build_lib into site-packages. An editable wheel (pip install -e)
    holds nothing from build_lib, only what install commands write into the unpacked wheel,
    which setuptools (>= 64) makes the install command's install_lib; there the file goes.
    """
    from setuptools.command.build_py import build_py

    class build_py_with_pth(build_py):
        def run(self):
            super().run()
            self.copy_file(AUTOLOAD_PTH, self._pth_target(), preserve_mode=False)

        def get_outputs(self, include_bytecode=1):
            return super().get_outputs(include_bytecode) + ([] if self.editable_mode else [self._pth_target()])

        def _pth_target(self):
            top = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
            return os.path.join(top, os.path.basename(AUTOLOAD_PTH))

    return build_py_with_pth


def torch_tag(torch_version, cuda_version):
    """The local version label for a build against this torch: its release and its CUDA build,
    "torch2.11.0.cu130" for 2.11.0+cu130, "torch2.11.0.cpu" for a CPU-only torch."""
    release = torch_version.split("+")[0]
    build = "cu" + cuda_version.replace(".", "") if cuda_version else "cpu"
    return re.sub(r"[^a-z0-9]+", ".", f"torch{release}.{build}".lower()).strip(".")


def build_record(version, torch_version, cuda_version):
    """The text of gpumem/_build.py, which gpumem/_build_check.py reads."""
    return (
        '"""Written by setup.py when it built gpumem._C beside this file: the torch it was built '
        'against."""\n'
        f"VERSION = {version!r}\nTORCH_VERSION = {torch_version!r}\nTORCH_CUDA = {cuda_version!r}\n"
    )


def build_ext_with_record():
    """torch's BuildExtension, plus gpumem/_build.py written beside the compiled module."""
    import torch
    from torch.utils.cpp_extension import BuildExtension

    class build_ext_with_record(BuildExtension):
        def finalize_options(self):
            super().finalize_options()
            # File times cannot tell that a _C left by an earlier build was built against another torch.
            self.force = True

        def run(self):
            super().run()
            text = build_record(self.distribution.get_version(), str(torch.__version__), torch.version.cuda)
            with open(self._record_path(), "w") as record:
                record.write(text)

        def get_outputs(self):
            return super().get_outputs() + ([] if self.inplace else [self._record_path()])

        def _record_path(self):
            # Beside _C: in build_lib for a wheel, in the source tree for an in-place (editable) build.
            return os.path.join(os.path.dirname(self.get_ext_fullpath("gpumem._C")), "_build.py")

    return build_ext_with_record


def extension():
    from torch.utils.cpp_extension import CppExtension, library_paths

    cudart_dir, cudart = cudart_library()
    sources = sorted(
        glob.glob("csrc/core/*.cpp") + glob.glob("csrc/sharing/*.cpp") + glob.glob("csrc/backends/*.cpp")
        + glob.glob("csrc/torch/*.cpp") + ["csrc/python/module.cpp"]
    )
    rpaths = library_paths() + [cudart_dir]
    return CppExtension(
        name="gpumem._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc")] + cuda_include_dirs(),
        library_dirs=[cudart_dir],
        libraries=["c10_cuda", "torch_cuda", cudart],
        define_macros=[tuple(m.split("=")) for m in torch_feature_macros()],
        # -O3: a malloc+free pair through the adapter takes 6 to 8% fewer instructions than at -O2
        # (tools/count_instructions.sh's two adapter rings; docs/benchmarks.md).
        extra_compile_args=["-O3"],
        extra_link_args=[f"-Wl,-rpath,{path}" for path in rpaths],
    )


if __name__ == "__main__":
    import torch
    from setuptools import find_packages, setup

    setup(
        name="gpumem",
        version=f"{VERSION}+{torch_tag(str(torch.__version__), torch.version.cuda)}",
        package_dir={"": "python"},
        packages=find_packages("python"),  # gpumem and its subpackages
        py_modules=["_gpumem_autoload", "_gpumem_command"],
        ext_modules=[extension()],
        cmdclass={"build_ext": build_ext_with_record(), "build_py": build_py_with_autoload_pth()},
    )

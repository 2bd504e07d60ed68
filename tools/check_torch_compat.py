#!/usr/bin/env python3
"""Checks that the torch adapter compiles against the headers of several PyTorch releases.

For each version: find its headers (installed torch, a cache of extracted headers, a wheel in
the cache, or `pip download` of the wheel, never installed), probe them with setup.py's
torch_feature_macros() as the real builds do, and run `g++ -fsyntax-only` on every
csrc/torch/*.cpp, csrc/python/module.cpp and one generated file that instantiates
TorchAllocator (a release that adds a pure virtual leaves it abstract, which -fsyntax-only of
the adapter's own files does not catch). Prints a Markdown table; exits non-zero when a required
version fails.

    python3 tools/check_torch_compat.py                      # the versions docs/compatibility.md lists
    python3 tools/check_torch_compat.py --versions 2.6.0 latest --required latest
    python3 tools/check_torch_compat.py --headers 2.9.1=/path/to/site-packages/torch/include

Needs g++, the CUDA runtime's headers (--cuda-include; by default $CUDA_HOME/include, else
/usr/local/cuda/include, else those pip's nvidia-cuda-runtime wheel put beside torch) and, for a
version whose headers are not at hand, pip and about 1 GB of disk per wheel while it downloads.
"""
import argparse
import concurrent.futures
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_versions(path=os.path.join(ROOT, "tools", "torch-versions")):
    """tools/torch-versions as a dict: {"TORCH_MAIN": "2.11.0", "TORCH_OLDEST": ..., ...}."""
    with open(path, encoding="utf-8") as lines:
        return dict(line.strip().split("=", 1) for line in lines if re.match(r"TORCH_[A-Z]+=", line))


SUPPORTED = torch_versions()
# The latest patch of every minor release from 2.4 on. A failure of a required one fails the run:
# the supported range's ends and the releases whose interface changes the adapter follows.
VERSIONS = ["2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
REQUIRED = sorted({SUPPORTED["TORCH_OLDEST"], "2.8.0", "2.9.1", SUPPORTED["TORCH_MAIN"], SUPPORTED["TORCH_NEWEST"]},
                  key=lambda v: tuple(int(p) for p in v.split(".")))
DEFAULT_CACHE = os.environ.get("GPUMEM_TORCH_COMPAT_CACHE", os.path.expanduser("~/.cache/gpumem/torch-compat"))
TORCH_CONFIG = "torch/share/cmake/Torch/TorchConfig.cmake"
# Instantiating the adapter: fails when torch declares a pure virtual gpumem does not implement.
CONCRETE_CHECK = """\
#include <type_traits>
#include "torch/allocator.h"
gpumem::TorchAllocator* make(gpumem::Backend& backend) { return new gpumem::TorchAllocator(backend, nullptr); }
static_assert(!std::is_abstract_v<gpumem::TorchAllocator>, "gpumem::TorchAllocator leaves a torch pure virtual unimplemented");
"""


def load_setup():
    spec = importlib.util.spec_from_file_location("gpumem_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def version_key(version):
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def latest_release():
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"],
                         capture_output=True, text=True, check=True).stdout
    return re.search(r"torch \(([^)]+)\)", out).group(1)


# ---- finding a version's headers ---------------------------------------------------------------

def installed_torch():
    """(version, directory of the torch package) of the importable torch, or None."""
    probe = "import os, torch; print(torch.__version__); print(os.path.dirname(torch.__file__))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    version, path = result.stdout.split()[-2:]
    return version.split("+")[0], path


def find_wheel(cache, version):
    found = sorted(glob.glob(os.path.join(cache, f"torch-{version}-*.whl")))
    return found[0] if found else None


def extract(wheel, dest, members=None):
    """torch/include, torch/version.py and TorchConfig.cmake (which tells the ABI) from a wheel."""
    wanted = members or (lambda n: n.startswith("torch/include/") or n in ("torch/version.py", TORCH_CONFIG))
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if wanted(name) and not name.endswith("/"):
                archive.extract(name, dest)


def download(cache, version):
    print(f"[{version}] pip download torch=={version} (about 1 GB) into {cache}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--dest", cache, f"torch=={version}"], check=True, stdout=sys.stderr)
    wheel = find_wheel(cache, version)
    if not wheel:
        raise RuntimeError(f"pip download of torch=={version} left no torch-{version}-*.whl in {cache}")
    return wheel


def torch_dir(version, cache, given, installed, keep_wheels):
    """The directory holding torch/include for `version` (a torch package directory's parent)."""
    if version in given:
        return given[version]
    if installed and installed[0] == version:
        return os.path.dirname(installed[1])
    dest = os.path.join(cache, "hdr", version)
    wheel = find_wheel(cache, version)
    if not os.path.isdir(os.path.join(dest, "torch", "include")):
        os.makedirs(cache, exist_ok=True)
        downloaded = not wheel
        wheel = wheel or download(cache, version)
        print(f"[{version}] extracting headers from {os.path.basename(wheel)}", file=sys.stderr, flush=True)
        partial = dest + ".partial"  # an interrupted extraction must not pass for headers
        shutil.rmtree(partial, ignore_errors=True)
        extract(wheel, partial)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(partial, dest)
        if downloaded and not keep_wheels:
            os.remove(wheel)  # the headers are all this needs: about 60 MB of the wheel's 1 GB
    elif wheel and not os.path.exists(os.path.join(dest, TORCH_CONFIG)):
        extract(wheel, dest, lambda n: n == TORCH_CONFIG)
    return dest


def cxx11_abi(root, version, installed):
    """1 or 0: the libstdc++ ABI the release's libraries use (PyPI wheels before 2.7 used the old one)."""
    if installed and os.path.dirname(installed[1]) == root:
        probe = "import torch; print(int(torch.compiled_with_cxx11_abi()))"
        return int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip())
    config = os.path.join(root, TORCH_CONFIG)
    if os.path.exists(config):
        return 0 if "_GLIBCXX_USE_CXX11_ABI=0" in open(config).read() else 1
    return 1 if version_key(version) >= (2, 7) else 0


def cuda_include_dir(installed):
    """Where cuda_runtime_api.h is: a toolkit, or the nvidia-cuda-runtime wheel torch depends on."""
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    if installed:
        site = os.path.dirname(installed[1])
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    for candidate in candidates:
        if os.path.exists(os.path.join(candidate, "cuda_runtime_api.h")):
            return candidate
    sys.exit("no cuda_runtime_api.h found: set CUDA_HOME or pass --cuda-include (pip install "
             "nvidia-cuda-runtime-cu12 or 'cuda-toolkit[cudart]' provides one; see docs/compatibility.md)")


def built_for_cuda(root):
    """The CUDA version the release's wheel was built for, from torch/version.py."""
    path = os.path.join(root, "torch", "version.py")
    found = re.search(r"^cuda\b.*=\s*'([^']+)'", open(path).read(), re.M) if os.path.exists(path) else None
    return found.group(1) if found else "?"


# ---- compiling ---------------------------------------------------------------------------------

def sources():
    return sorted(glob.glob(os.path.join(ROOT, "csrc", "torch", "*.cpp"))) + [os.path.join(ROOT, "csrc", "python", "module.cpp")]


def compile_flags(include, macros, version, abi, cuda_include):
    standard = "c++20" if version_key(version) >= (2, 13) else "c++17"
    return standard, [
        f"-std={standard}", "-fsyntax-only", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-D{m}" for m in macros),
        "-I", os.path.join(ROOT, "csrc"),
        "-isystem", include, "-isystem", os.path.join(include, "torch", "csrc", "api", "include"),
        "-isystem", cuda_include, "-isystem", sysconfig.get_paths()["include"],
    ]


def first_error(output):
    """The first error line, and for an abstract class the first pure virtual left unimplemented."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if " error: " in line or line.startswith("error:"):
            error = line.replace(ROOT + os.sep, "")
            if "abstract class type" in line:
                pure = next((n for n in lines[i:] if re.search(r"note:\s+.virtual ", n)), None)
                error += " (" + re.sub(r".*note:\s+", "", pure) + ")" if pure else ""
            return error
    return lines[-1] if lines else "compiler failed with no output"


def compile_one(job):
    version, flags, source = job
    result = subprocess.run(["g++", *flags, source], capture_output=True, text=True)
    return version, source, result.returncode == 0, result.stderr


def short(macro):
    return macro.replace("GPUMEM_TORCH_HAS_", "").split("=")[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=VERSIONS,
                        help="torch versions to check; 'latest' asks pip for the newest release (default: %(default)s)")
    parser.add_argument("--required", nargs="*", default=REQUIRED,
                        help="versions whose failure fails the run (default: %(default)s)")
    parser.add_argument("--headers", nargs="*", default=[], metavar="VERSION=DIR",
                        help="use DIR (holding torch/include, or torch/include itself) for VERSION")
    parser.add_argument("--cache", default=DEFAULT_CACHE, help="wheels and extracted headers (default: %(default)s)")
    parser.add_argument("--keep-wheels", action="store_true", help="keep downloaded wheels (default: only their headers)")
    parser.add_argument("--cuda-include", help="directory holding cuda_runtime_api.h (default: found as above)")
    parser.add_argument("--only", nargs="*", default=[], help="compile only sources whose file name is listed")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="print every failing compiler output")
    args = parser.parse_args()

    setup = load_setup()
    installed = installed_torch()
    cuda_include = args.cuda_include or cuda_include_dir(installed)
    latest = latest_release() if "latest" in args.versions + args.required else None
    versions = [latest if v == "latest" else v for v in args.versions]
    required = [latest if v == "latest" else v for v in args.required]
    given = {}
    for item in args.headers:
        version, path = item.split("=", 1)
        path = os.path.abspath(path)
        given[version] = os.path.dirname(os.path.dirname(path)) if path.rstrip("/").endswith("torch/include") else path

    work = tempfile.TemporaryDirectory(prefix="gpumem-compat-")
    concrete = os.path.join(work.name, "concrete_check.cpp")
    open(concrete, "w").write(CONCRETE_CHECK)
    files = [s for s in sources() if not args.only or os.path.basename(s) in args.only] + [concrete]

    rows, jobs = {}, []
    for version in versions:
        root = torch_dir(version, args.cache, given, installed, args.keep_wheels)
        include = os.path.join(root, "torch", "include")
        macros = setup.torch_feature_macros(include)
        abi = cxx11_abi(root, version, installed)
        standard, flags = compile_flags(include, macros, version, abi, cuda_include)
        rows[version] = {"standard": standard, "abi": abi, "cuda": built_for_cuda(root), "macros": [short(m) for m in macros if m.endswith("=1")],
                         "failures": []}
        jobs += [(version, flags, source) for source in files]

    print(f"g++ -fsyntax-only: {len(files)} files x {len(versions)} versions, {args.jobs} jobs; CUDA headers from "
          f"{cuda_include}", file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for version, source, ok, output in pool.map(compile_one, jobs):
            name = os.path.relpath(source, ROOT) if source != concrete else "TorchAllocator instantiation"
            print(f"  [{version}] {name}: {'ok' if ok else 'FAILED'}", file=sys.stderr, flush=True)
            if not ok:
                rows[version]["failures"].append((name, first_error(output)))
                if args.verbose:
                    print(output, file=sys.stderr)

    print("| torch | built for CUDA | C++ | ABI | GPUMEM_TORCH_HAS_* set | result |")
    print("|---|---|---|---|---|---|")
    failed_required = []
    for version in versions:
        row = rows[version]
        if row["failures"]:
            name, error = row["failures"][0]
            result = f"failed ({len(row['failures'])} files): {name}: {error}".replace("|", "\\|")
            if version in required:
                failed_required.append(version)
        else:
            result = "ok"
        print(f"| {version}{'' if version in required else ' (optional)'} | {row['cuda']} | {row['standard']} | {row['abi']} | {' '.join(row['macros']) or '(none)'} | {result} |")
    if failed_required:
        print(f"required versions failing: {', '.join(failed_required)}", file=sys.stderr)
    return 1 if failed_required else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Offline compile check of generated GPU kernel sources; no GPU needed.

CUDA: every DIR/*.cu is compiled with NVRTC (through ctypes) using the options cubecl-cuda
0.11.3 passes at run time (src/compute/context.rs, `compile_to_ptx`):
    --gpu-architecture=sm_XX   (sm_XXa from sm_90 on), --include-path=<cuda>/include,
    -lineinfo, --include-path=<cuda>/include/cccl
and the PTX is assembled with `ptxas -v --gpu-name <arch>`; its report gives per kernel the
registers, static shared memory, stack frame (local memory), spill stores and loads, and
the waits or arrives it inserted around warpgroup products (C7510/C7517/C7519).

HIP: every DIR/*.hip is compiled for each --offload-arch with clang (device code only) the
way hipRTC compiles it at run time: hipRTC's builtin header (hip_runtime.h, hip_fp16.h,
hip_bfloat16.h and the device-function headers, with __HIPCC_RTC__ defined and no C/C++
standard library) is rebuilt from the HIP headers as a prelude, plus cubecl-hip's own options
(--std=c++17 -O3 -I<hip include>). Resource usage comes from
-Rpass-analysis=kernel-resource-usage. A source that includes <rocwmma/...> is reported as
'unverified: needs rocWMMA' (not a failure) when no complete rocWMMA is installed.

usage:
  python3 tools/compile_check.py --cuda-dir DIR --arch sm_80 --arch sm_90 \\
      [--hip-dir DIR --offload-arch gfx90a --offload-arch gfx942] --json OUT.json
  python3 tools/compile_check.py --self-test --json OUT.json   # built-in samples

Tools are found from the variables that tools/install_compilers.sh writes to
<prefix>/env.sh (NVRTC_LIB, FC_CUDA_ROOT, FC_PTXAS, FC_HIP_CLANG, FC_HIP_DEVICE_LIBS,
FC_HIP_INCLUDE, ROCWMMA_INCLUDE), else from the prefix (--prefix, $FLASH_COMPILERS_PREFIX,
default /opt/flash-compilers), else (CUDA) from pip-installed `nvidia` packages on sys.path.

Exit status: 0 all compiled (unverified sources allowed), 1 a compile or assemble failed,
2 bad input (no such folder, no sources, bad arch), 3 a compiler or header set is not
installed (run tools/install_compilers.sh).
"""

import argparse
import concurrent.futures
import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

LOG_LIMIT = 20000


class SetupError(Exception):
    """Bad input (exit 2)."""


class MissingTool(SetupError):
    """No compiler for the requested target installed (exit 3)."""


# ----------------------------------------------------------------------------------------
# CUDA


def find_nvrtc(prefix):
    cands = []
    if os.environ.get("NVRTC_LIB"):
        cands.append(os.environ["NVRTC_LIB"])
    if os.environ.get("FC_CUDA_ROOT"):
        cands.append(os.path.join(os.environ["FC_CUDA_ROOT"], "lib", "libnvrtc.so.13"))
    cands.append(os.path.join(prefix, "cuda", "nvidia", "cu13", "lib", "libnvrtc.so.13"))
    for p in sys.path:
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "cu1*", "lib", "libnvrtc.so.1*")))
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.1*")))
    for c in cands:
        if c and os.path.isfile(c):
            return os.path.abspath(c)
    raise MissingTool("NVRTC not found: set NVRTC_LIB or run tools/install_compilers.sh")


def find_cuda_root(nvrtc_lib):
    """The folder with include/cuda_fp16.h (pip layout: nvidia/cu13 holds lib/ and include/)."""
    cands = [os.environ.get("FC_CUDA_ROOT"), os.path.dirname(os.path.dirname(nvrtc_lib))]
    for p in sys.path:
        cands += glob.glob(os.path.join(p, "nvidia", "cu1*"))
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "include", "cuda_fp16.h")):
            return os.path.abspath(c)
    raise MissingTool("CUDA headers (include/cuda_fp16.h) not found: set FC_CUDA_ROOT")


def find_ptxas(cuda_root):
    for c in (os.environ.get("FC_PTXAS"), os.path.join(cuda_root, "bin", "ptxas"),
              shutil.which("ptxas")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise MissingTool("ptxas not found: set FC_PTXAS (pip wheel nvidia-cuda-nvcc)")


def normalize_sm(arch):
    """sm_90 -> sm_90a as cubecl-cuda does for every arch >= 90; sm_80 stays."""
    m = re.fullmatch(r"(?:sm_)?(\d+)([af]?)", arch.strip())
    if not m:
        raise SetupError(f"bad CUDA arch '{arch}' (expected e.g. sm_80, sm_90, sm_90a)")
    ver, suffix = int(m.group(1)), m.group(2)
    if not suffix and ver >= 90:
        suffix = "a"
    return f"sm_{ver}{suffix}"


class Nvrtc:
    def __init__(self, path):
        libdir = os.path.dirname(path)
        # libnvrtc dlopen()s its builtins by soname; load them first so it finds them
        # without LD_LIBRARY_PATH.
        for b in sorted(glob.glob(os.path.join(libdir, "libnvrtc-builtins.so.*"))):
            if ".alt." not in b:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"
        self.path = path

    def compile(self, source, options):
        """Returns (ok, ptx_bytes, log)."""
        lib = self.lib
        prog = ctypes.c_void_p()
        r = lib.nvrtcCreateProgram(ctypes.byref(prog), source, None, 0, None, None)
        if r != 0:
            return False, b"", "nvrtcCreateProgram: " + lib.nvrtcGetErrorString(r).decode()
        try:
            opts = [o.encode() for o in options]
            arr = (ctypes.c_char_p * len(opts))(*opts)
            r = lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if r != 0:
                return False, b"", (lib.nvrtcGetErrorString(r).decode() + "\n" + log).strip()
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetPTX(prog, buf)
            return True, buf.value, log.strip()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def parse_ptxas(text):
    """Per function: ptxas -v 'info' lines (CUDA 11-13 formats)."""
    funcs, cur = {}, None

    def rec(name):
        return funcs.setdefault(name, {"name": name, "entry": False})

    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = rec(m.group(1))
            cur["entry"] = True
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = rec(m.group(1))
            continue
        if cur is None:
            continue
        for key, pat in (("stack_frame_bytes", r"(\d+) bytes stack frame"),
                         ("spill_stores_bytes", r"(\d+) bytes spill stores"),
                         ("spill_loads_bytes", r"(\d+) bytes spill loads"),
                         ("registers", r"Used (\d+) registers"),
                         ("barriers", r"used (\d+) barriers"),
                         ("smem_bytes", r"(\d+) bytes smem"),
                         ("lmem_bytes", r"(\d+) bytes lmem"),
                         ("cumulative_stack_bytes", r"(\d+) bytes cumulative stack size")):
            m = re.search(pat, line)
            if m:
                cur[key] = int(m.group(1))
        for m in re.finditer(r"(\d+) bytes cmem\[(\d+)\]", line):
            cur.setdefault("cmem_bytes", {})[m.group(2)] = int(m.group(1))
    # Warpgroup products the assembler had to synchronize itself (C7510 serialized, C7517
    # a wait, C7519 an arrive inserted): registers touched while products still write them.
    for m in re.finditer(r"\((C75\d\d)\) (.*?) in function '([^']+)'", text):
        rec(m.group(3)).setdefault("wgmma_syncs", []).append(f"{m.group(1)} {m.group(2)}")
    out = []
    for f in funcs.values():
        if f["entry"]:
            f.setdefault("smem_bytes", 0)
            f["local_bytes"] = max(f.get("stack_frame_bytes", 0), f.get("lmem_bytes", 0))
        out.append(f)
    return out


def cuda_job(nvrtc, ptxas, cuda_root, src, arch, workdir, timeout):
    inc = os.path.join(cuda_root, "include")
    cccl = os.path.join(inc, "cccl")
    options = [f"--gpu-architecture={arch}", f"--include-path={inc}", "-lineinfo"]
    if os.path.isdir(cccl):
        options.append(f"--include-path={cccl}")
    res = {"backend": "cuda", "source": os.path.basename(src), "path": os.path.abspath(src),
           "arch": arch, "compiler_options": options, "kernels": []}
    t0 = time.monotonic()
    ok, ptx, log = nvrtc.compile(open(src, "rb").read(), options)
    res["compile_s"] = round(time.monotonic() - t0, 3)
    res["compile_log"] = log[:LOG_LIMIT]
    if not ok:
        res.update(status="fail", stage="nvrtc", error=first_error(log))
        return res
    stem = os.path.join(workdir, f"{os.path.splitext(res['source'])[0]}.{arch}")
    with open(stem + ".ptx", "wb") as f:
        f.write(ptx)
    text = ptx.decode(errors="replace")
    m = re.search(r"^\.version\s+(\S+)", text, re.M)
    res["ptx_isa"] = m.group(1) if m else None
    res["ptx_entries"] = re.findall(r"\.entry\s+(\w+)", text)
    res["ptx_counts"] = {k: text.count(k) for k in ("mma.sync", "wmma.mma", "wgmma", "ldmatrix",
                                                     "cp.async", "shfl.sync")}
    cmd = [ptxas, "-v", "--gpu-name", arch, stem + ".ptx", "-o", stem + ".cubin"]
    res["assembler_command"] = cmd
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        res.update(status="fail", stage="ptxas", error=f"ptxas timed out after {timeout} s")
        return res
    res["assemble_s"] = round(time.monotonic() - t0, 3)
    out = (p.stdout + p.stderr).strip()
    res["assembler_log"] = out[:LOG_LIMIT]
    if p.returncode != 0:
        res.update(status="fail", stage="ptxas", error=first_error(out))
        return res
    res["kernels"] = parse_ptxas(out)
    res["status"] = "ok"
    return res


# ----------------------------------------------------------------------------------------
# HIP

# hipRTC's builtin header: hipamd/src/hiprtc/cmake/HIPRTC.cmake (generate_hiprtc_header)
# preprocesses the first three with __HIPCC_RTC__, CMakeLists.txt's HIPRTC_HEADERS are
# appended. Here all of them are included in that order; headers that a HIP version lacks
# are left out.
HIPRTC_HEADERS = [
    "hip/hip_runtime.h",
    "hip/hip_common.h", "hip/amd_detail/device_library_decls.h", "hip/amd_detail/hip_assert.h",
    "hip/library_types.h", "hip/driver_types.h", "hip/surface_types.h",
    "hip/amd_detail/amd_channel_descriptor.h", "hip/texture_types.h",
    "hip/amd_detail/ockl_image.h", "hip/amd_detail/texture_fetch_functions.h",
    "hip/amd_detail/texture_indirect_functions.h", "hip/amd_detail/amd_surface_functions.h",
    "hip/amd_detail/amd_hip_complex.h", "hip/amd_detail/amd_hip_math_constants.h",
    "hip/amd_detail/math_fwd.h", "hip/amd_detail/amd_warp_functions.h",
    "hip/amd_detail/amd_device_functions.h", "hip/amd_detail/amd_warp_sync_functions.h",
    "hip/amd_detail/hip_cooperative_groups_helper.h",
    "hip/amd_detail/amd_hip_cooperative_groups.h", "hip/amd_detail/amd_hip_unsafe_atomics.h",
    "hip/amd_detail/amd_hip_atomic.h", "hip/amd_detail/hip_fp16_math_fwd.h",
    "hip/amd_detail/amd_hip_fp16.h", "hip/amd_detail/amd_math_functions.h",
    # hip_fp16.h/hip_bfloat16.h come last: their __shfl overloads default to `warpSize`,
    # which amd_warp_functions.h declares.
    "hip/hip_fp16.h", "hip/hip_bfloat16.h",
]

ROCWMMA_RE = re.compile(r'^\s*#\s*include\s*[<"]rocwmma/', re.M)

REMARK_KEYS = {
    "SGPRs": "sgprs", "VGPRs": "vgprs", "AGPRs": "agprs",
    "ScratchSize [bytes/lane]": "scratch_bytes_per_lane", "Dynamic Stack": "dynamic_stack",
    "Occupancy [waves/SIMD]": "occupancy_waves_per_simd", "SGPRs Spill": "sgpr_spills",
    "VGPRs Spill": "vgpr_spills", "LDS Size [bytes/block]": "lds_bytes",
}


class HipToolchain:
    def __init__(self, prefix):
        llvm = os.path.join(prefix, "trixie", "usr", "lib", "llvm-17")
        self.clang = os.environ.get("FC_HIP_CLANG") or os.path.join(llvm, "bin", "clang++")
        self.device_libs = (os.environ.get("FC_HIP_DEVICE_LIBS")
                            or os.path.join(llvm, "lib", "clang", "17", "amdgcn", "bitcode"))
        self.hip_include = os.environ.get("FC_HIP_INCLUDE") or os.path.join(prefix, "hip", "include")
        wmma = os.environ.get("ROCWMMA_INCLUDE") or os.path.join(prefix, "rocwmma", "include")
        # A usable rocWMMA has its internal/ headers (Debian's 7.2.4-1~exp1 package has not).
        self.rocwmma = wmma if os.path.isdir(os.path.join(wmma, "rocwmma", "internal")) else None
        if not (os.path.isfile(self.clang) and os.access(self.clang, os.X_OK)):
            raise MissingTool(f"HIP clang not found at {self.clang}: set FC_HIP_CLANG")
        if not os.path.isfile(os.path.join(self.device_libs, "ockl.bc")):
            raise MissingTool(f"ROCm device libraries not found in {self.device_libs}")
        if not os.path.isfile(os.path.join(self.hip_include, "hip", "hip_runtime.h")):
            raise MissingTool(f"HIP headers not found in {self.hip_include}: set FC_HIP_INCLUDE")
        p = subprocess.run([self.clang, "--version"], capture_output=True, text=True)
        self.version = (p.stdout.splitlines() or ["?"])[0]
        self.hip_version = hip_header_version(self.hip_include)
        self.prelude = None

    def write_prelude(self, workdir):
        lines = ['#pragma push_macro("CHAR_BIT")', '#pragma push_macro("INT_MAX")',
                 "#define CHAR_BIT __CHAR_BIT__", "#define INT_MAX __INTMAX_MAX__"]
        lines += [f"#include <{h}>" for h in HIPRTC_HEADERS
                  if os.path.isfile(os.path.join(self.hip_include, h))]
        lines += ['#pragma pop_macro("CHAR_BIT")', '#pragma pop_macro("INT_MAX")']
        self.prelude = os.path.join(workdir, "hiprtc_prelude.h")
        with open(self.prelude, "w") as f:
            f.write("\n".join(lines) + "\n")

    def command(self, src, arch, out):
        cmd = [self.clang, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only",
               "--no-gpu-bundle-output", "-nogpuinc", "-nostdlibinc",
               f"--rocm-device-lib-path={self.device_libs}", "-D__HIPCC_RTC__",
               "-include", "__clang_hip_runtime_wrapper.h", "-include", self.prelude,
               "--std=c++17", "-isystem", self.hip_include]
        if self.rocwmma:
            cmd += ["-isystem", self.rocwmma]
        cmd += ["-O3", "-Rpass-analysis=kernel-resource-usage", "-c", src, "-o", out]
        return cmd


def hip_header_version(inc):
    try:
        text = open(os.path.join(inc, "hip", "hip_version.h")).read()
        parts = [re.search(rf"#define HIP_VERSION_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
        return ".".join(p.group(1) for p in parts if p)
    except OSError:
        return None


def parse_remarks(text):
    funcs, cur = [], None
    for m in re.finditer(r"remark:\s+([^:\n]+?):\s+(.*?)\s+\[-Rpass-analysis=kernel-resource-usage\]", text):
        key, val = m.group(1).strip(), m.group(2).strip()
        if key == "Function Name":
            cur = {"name": val}
            funcs.append(cur)
        elif cur is not None:
            k = REMARK_KEYS.get(key, re.sub(r"\W+", "_", key).strip("_").lower())
            cur[k] = int(val) if re.fullmatch(r"-?\d+", val) else val
    return funcs


def hip_job(tc, src, arch, workdir, timeout):
    res = {"backend": "hip", "source": os.path.basename(src), "path": os.path.abspath(src),
           "arch": arch, "kernels": []}
    text = open(src, "rb").read().decode(errors="replace")
    res["needs_rocwmma"] = bool(ROCWMMA_RE.search(text))
    if res["needs_rocwmma"] and not tc.rocwmma:
        res.update(status="unverified", reason="needs rocWMMA")
        return res
    out = os.path.join(workdir, f"{os.path.splitext(res['source'])[0]}.{arch}.co")
    cmd = tc.command(src, arch, out)
    res["command"] = cmd
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        res.update(status="fail", stage="clang", error=f"clang timed out after {timeout} s")
        return res
    res["compile_s"] = round(time.monotonic() - t0, 3)
    log = (p.stdout + p.stderr).strip()
    res["kernels"] = parse_remarks(log)
    res["compile_log"] = "\n".join(l for l in log.splitlines()
                                   if "kernel-resource-usage" not in l)[:LOG_LIMIT]
    if p.returncode != 0:
        res.update(status="fail", stage="clang", error=first_error(log))
        return res
    with open(out, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF" or int.from_bytes(head[18:20], "little") != 224:  # EM_AMDGPU
        res.update(status="fail", stage="clang", error="output is not an AMDGPU code object")
        return res
    res["status"] = "ok"
    return res


# ----------------------------------------------------------------------------------------


def first_error(log):
    for line in log.splitlines():
        if re.search(r"\berror\b|fatal", line, re.I):
            return line.strip()[:300]
    return (log.strip().splitlines() or ["(no log)"])[0][:300]


def describe(r):
    head = f"{r['status'].upper():10} {r['backend']:4} {r['arch']:7} {r['source']}"
    if r["status"] == "unverified":
        return [f"{head}  (unverified: {r['reason']})"]
    if r["status"] == "fail":
        return [f"{head}  {r['stage']}: {r['error']}"]
    lines = []
    for k in r["kernels"]:
        if r["backend"] == "cuda":
            if not k.get("entry"):
                continue
            spill = k.get("spill_stores_bytes", 0) + k.get("spill_loads_bytes", 0)
            lines.append(f"{head}  {k['name']}: regs={k.get('registers')} smem={k.get('smem_bytes')}B "
                         f"local={k.get('local_bytes')}B spill_st={k.get('spill_stores_bytes', 0)}B "
                         f"spill_ld={k.get('spill_loads_bytes', 0)}B" + ("  [spills]" if spill else "")
                         + (f"  [wgmma syncs inserted: {len(k['wgmma_syncs'])}]"
                            if k.get("wgmma_syncs") else ""))
        else:
            spill = k.get("sgpr_spills", 0) + k.get("vgpr_spills", 0)
            lines.append(f"{head}  {k['name']}: vgpr={k.get('vgprs')} agpr={k.get('agprs')} "
                         f"sgpr={k.get('sgprs')} scratch={k.get('scratch_bytes_per_lane')}B/lane "
                         f"lds={k.get('lds_bytes')}B occupancy={k.get('occupancy_waves_per_simd')} "
                         f"spills={k.get('sgpr_spills', 0)}s/{k.get('vgpr_spills', 0)}v"
                         + ("  [spills]" if spill else ""))
    return lines or [f"{head}  (no kernels reported)"]


def sources(d, ext):
    if not os.path.isdir(d):
        raise SetupError(f"{d}: not a folder")
    found = sorted(glob.glob(os.path.join(d, f"*{ext}")))
    if not found:
        raise SetupError(f"{d}: no *{ext} files")
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuda-dir", help="folder of generated .cu files")
    ap.add_argument("--arch", action="append", default=[], help="CUDA arch (sm_80, sm_90, ...)")
    ap.add_argument("--hip-dir", help="folder of generated .hip files")
    ap.add_argument("--offload-arch", action="append", default=[], help="AMD arch (gfx90a, gfx942)")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--prefix", default=os.environ.get("FLASH_COMPILERS_PREFIX", "/opt/flash-compilers"))
    ap.add_argument("--keep", help="keep PTX, cubins and code objects in this folder")
    ap.add_argument("-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per compile")
    ap.add_argument("--self-test", action="store_true", help="check the built-in samples")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    selftmp = None
    if args.self_test:
        selftmp = tempfile.mkdtemp(prefix="compile_check_selftest_")
        args.cuda_dir, args.hip_dir = write_samples(selftmp)
        args.arch = args.arch or ["sm_80", "sm_90"]
        args.offload_arch = args.offload_arch or ["gfx90a", "gfx942"]
    if not args.cuda_dir and not args.hip_dir:
        ap.error("give --cuda-dir and/or --hip-dir (or --self-test)")
    if args.cuda_dir and not args.arch:
        ap.error("--cuda-dir needs at least one --arch")
    if args.hip_dir and not args.offload_arch:
        ap.error("--hip-dir needs at least one --offload-arch")

    workdir = args.keep or tempfile.mkdtemp(prefix="compile_check_")
    os.makedirs(workdir, exist_ok=True)
    report = {"tools": {}, "results": []}
    jobs = []
    try:
        if args.cuda_dir:
            nvrtc = Nvrtc(find_nvrtc(args.prefix))
            root = find_cuda_root(nvrtc.path)
            ptxas = find_ptxas(root)
            pv = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
            report["tools"]["cuda"] = {
                "nvrtc": nvrtc.path, "nvrtc_version": nvrtc.version, "cuda_root": root,
                "ptxas": ptxas, "ptxas_version": (pv.strip().splitlines() or ["?"])[-1]}
            archs = [normalize_sm(a) for a in args.arch]
            for src in sources(args.cuda_dir, ".cu"):
                for a in archs:
                    jobs.append(lambda s=src, a=a: cuda_job(nvrtc, ptxas, root, s, a, workdir, args.timeout))
        if args.hip_dir:
            tc = HipToolchain(args.prefix)
            tc.write_prelude(workdir)
            report["tools"]["hip"] = {
                "clang": tc.clang, "clang_version": tc.version, "device_libs": tc.device_libs,
                "hip_include": tc.hip_include, "hip_headers_version": tc.hip_version,
                "rocwmma_include": tc.rocwmma, "prelude": tc.prelude}
            for src in sources(args.hip_dir, ".hip"):
                for a in args.offload_arch:
                    jobs.append(lambda s=src, a=a: hip_job(tc, s, a, workdir, args.timeout))
    except MissingTool as e:
        print(f"compile_check: not installed: {e}", file=sys.stderr)
        return 3
    except SetupError as e:
        print(f"compile_check: bad input: {e}", file=sys.stderr)
        return 2

    for name, info in report["tools"].items():
        print(f"# {name}: " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "prelude"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for r in ex.map(lambda j: j(), jobs):
            report["results"].append(r)
            for line in describe(r):
                print(line, flush=True)
            if r["status"] == "fail":
                print("      " + "\n      ".join((r.get("compile_log") or r.get("assembler_log") or "")
                                                  .splitlines()[:30]), flush=True)

    res = report["results"]
    count = {s: sum(r["status"] == s for r in res) for s in ("ok", "fail", "unverified")}
    spills = sorted({(r["backend"], r["arch"], k["name"]) for r in res for k in r["kernels"]
                     if k.get("spill_stores_bytes", 0) + k.get("spill_loads_bytes", 0)
                     + k.get("sgpr_spills", 0) + k.get("vgpr_spills", 0)})
    syncs = sorted({(r["arch"], k["name"], len(k["wgmma_syncs"])) for r in res
                    for k in r["kernels"] if k.get("wgmma_syncs")})
    report["summary"] = {**count, "kernels_with_spills": [list(s) for s in spills],
                         "kernels_with_inserted_wgmma_syncs": [list(s) for s in syncs],
                         "unverified_sources": sorted({r["source"] for r in res if r["status"] == "unverified"}),
                         "elapsed_s": round(time.monotonic() - t_start, 1)}
    for b in ("cuda", "hip"):
        rb = [r for r in res if r["backend"] == b]
        if rb:
            print(f"# {b}: {len({r['source'] for r in rb})} sources x {len({r['arch'] for r in rb})} archs: "
                  + ", ".join(f"{s} {sum(r['status'] == s for r in rb)}" for s in ("ok", "fail", "unverified")))
    if spills:
        print("# kernels with register spills: " + ", ".join(f"{n} ({a})" for _, a, n in spills))
    if syncs:
        print("# kernels whose warpgroup products the assembler synchronized: "
              + ", ".join(f"{n} ({a}: {c})" for a, n, c in syncs))
    if report["summary"]["unverified_sources"]:
        print("# unverified (needs rocWMMA, not installed): " + ", ".join(report["summary"]["unverified_sources"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"compile_check: {count['ok']} passed, {count['fail']} failed, {count['unverified']} skipped")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if selftmp:
        shutil.rmtree(selftmp, ignore_errors=True)
    return 1 if count["fail"] else 0


# ----------------------------------------------------------------------------------------
# Built-in samples for --self-test, written the way CubeCL 0.11's C++ backends emit kernels
# (type preamble, `array` polyfill, extern "C" __global__ with __launch_bounds__, dynamic
# shared memory as `extern __shared__ char[]`, infinities as (1.0f/0.0f)).

PREAMBLE = """typedef unsigned int uint32_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned long long int uint64_t;
typedef signed char int8_t;
typedef signed short int16_t;
typedef signed int int32_t;
typedef signed long long int int64_t;

template <typename T, size_t N>
struct array {
    T data[N];
    __device__ T& operator[](size_t i) { return data[i]; }
    __device__ const T& operator[](size_t i) const { return data[i]; }
};
"""

SAMPLE_CU = PREAMBLE + r"""
typedef struct CUtensorMap_st {
alignas(128) unsigned long long int opaque[16];
} CUtensorMap;
#include <mma.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/barrier>

extern "C" __global__ void __launch_bounds__(32) wmma_tile_f16(const __half* __restrict__ a, const __half* __restrict__ b, float* __restrict__ c) {
extern __shared__ __align__(128) char dynamic_shared_mem[];
__half* const sa = reinterpret_cast<__half*>(&dynamic_shared_mem[0]);
for (uint32_t i = threadIdx.x; i < 256u; i += 32u) { sa[i] = a[i]; }
__syncthreads();
nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> fa;
nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::col_major> fb;
nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> fc;
nvcuda::wmma::fill_fragment(fc, 0.0f);
nvcuda::wmma::load_matrix_sync(fa, sa, 16);
nvcuda::wmma::load_matrix_sync(fb, b, 16);
nvcuda::wmma::mma_sync(fc, fa, fb, fc);
nvcuda::wmma::store_matrix_sync(c, fc, 16, nvcuda::wmma::mem_row_major);
}

extern "C" __global__ void __launch_bounds__(32) mma_ldmatrix_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, float* __restrict__ d) {
__shared__ __align__(16) __nv_bfloat16 sa[256];
__shared__ __align__(16) __nv_bfloat16 sb[128];
const uint32_t lane = threadIdx.x;
for (uint32_t i = lane; i < 256u; i += 32u) { sa[i] = a[i]; }
for (uint32_t i = lane; i < 128u; i += 32u) { sb[i] = b[i]; }
__syncwarp();
uint32_t ra[4]; uint32_t rb[2]; float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
const uint32_t pa = static_cast<uint32_t>(__cvta_generic_to_shared(&sa[(lane % 16u) * 16u + (lane / 16u) * 8u]));
asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(ra[0]), "=r"(ra[1]), "=r"(ra[2]), "=r"(ra[3]) : "r"(pa));
const uint32_t pb = static_cast<uint32_t>(__cvta_generic_to_shared(&sb[(lane % 16u) * 8u]));
asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(rb[0]), "=r"(rb[1]) : "r"(pb));
asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
    : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
    : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]));
float m = fmaxf(fmaxf(acc[0], acc[1]), (-1.0f/0.0f));
m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
for (uint32_t i = 0; i < 4u; ++i) { d[lane * 4u + i] = __expf(acc[i] - m); }
}
"""

SAMPLE_HIP = PREAMBLE + r"""
extern "C" __global__ void __launch_bounds__(256) softmax_rows_f32(const float* __restrict__ input, float* __restrict__ output, const uint32_t* __restrict__ info) {
extern __shared__ __align__(16) char dynamic_shared_mem[];
float* const red = reinterpret_cast<float*>(&dynamic_shared_mem[0]);
const uint32_t cols = info[0];
const uint32_t lane = threadIdx.x % 64u;
const uint32_t wave = threadIdx.x / 64u;
array<float, 4> v;
float m = (-1.0f/0.0f);
for (uint32_t j = 0; j < 4u; ++j) {
    const uint32_t c = threadIdx.x + j * 256u;
    v[j] = c < cols ? input[blockIdx.x * cols + c] : (-1.0f/0.0f);
    m = fmaxf(m, v[j]);
}
for (uint32_t o = 32u; o > 0u; o >>= 1) { m = fmaxf(m, __shfl_xor(m, (int)o)); }
if (lane == 0u) { red[wave] = m; }
__syncthreads();
m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
__syncthreads();
float s = 0.0f;
for (uint32_t j = 0; j < 4u; ++j) { v[j] = __expf(v[j] - m); s += v[j]; }
for (uint32_t o = 32u; o > 0u; o >>= 1) { s += __shfl_xor(s, (int)o); }
if (lane == 0u) { red[wave] = s; }
__syncthreads();
s = red[0] + red[1] + red[2] + red[3];
for (uint32_t j = 0; j < 4u; ++j) {
    const uint32_t c = threadIdx.x + j * 256u;
    if (c < cols) { output[blockIdx.x * cols + c] = v[j] / s; }
}
__builtin_amdgcn_fence(__ATOMIC_ACQ_REL, "wavefront");
__builtin_amdgcn_wave_barrier();
}
"""

SAMPLE_HIP_BF16 = "#include <hip/hip_bf16.h>\n" + PREAMBLE + r"""
extern "C" __global__ void __launch_bounds__(128) scale_bf16(const __hip_bfloat16* __restrict__ x, const __half* __restrict__ y, __hip_bfloat16* __restrict__ out, const uint32_t* __restrict__ info) {
__shared__ float tile[128];
const uint32_t i = blockIdx.x * 128u + threadIdx.x;
float v = 0.0f;
if (i < info[0]) { v = __bfloat162float(x[i] * x[i]) * __half2float(y[i]); }
tile[threadIdx.x] = v;
__syncthreads();
float w = tile[(threadIdx.x + 1u) % 128u];
w = w + __shfl_xor(w, 1);
if (i < info[0]) { out[i] = __float2bfloat16(v + w); }
}
"""

SAMPLE_HIP_WMMA = "#include <rocwmma/rocwmma.hpp>\n" + PREAMBLE + r"""
extern "C" __global__ void __launch_bounds__(64) rocwmma_tile_f16(const __half* __restrict__ a, const __half* __restrict__ b, float* __restrict__ c) {
rocwmma::fragment<rocwmma::matrix_a, 16, 16, 16, __half, rocwmma::row_major> fa;
rocwmma::fragment<rocwmma::matrix_b, 16, 16, 16, __half, rocwmma::col_major> fb;
rocwmma::fragment<rocwmma::accumulator, 16, 16, 16, float> fc;
rocwmma::fill_fragment(fc, 0.0f);
rocwmma::load_matrix_sync(fa, a, 16);
rocwmma::load_matrix_sync(fb, b, 16);
rocwmma::mma_sync(fc, fa, fb, fc);
rocwmma::store_matrix_sync(c, fc, 16, rocwmma::mem_row_major);
}
"""


def write_samples(d):
    cu, hip = os.path.join(d, "cuda"), os.path.join(d, "hip")
    os.makedirs(cu)
    os.makedirs(hip)
    for folder, name, text in ((cu, "tensor_cores.cu", SAMPLE_CU), (hip, "softmax_rows.hip", SAMPLE_HIP),
                               (hip, "scale_bf16.hip", SAMPLE_HIP_BF16),
                               (hip, "rocwmma_tile.hip", SAMPLE_HIP_WMMA)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return cu, hip


if __name__ == "__main__":
    sys.exit(main())

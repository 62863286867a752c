#!/usr/bin/env bash
# Installs the compilers that tools/compile_check.py uses to compile the generated CUDA and
# HIP kernel sources without a GPU. Run as root; idempotent (each part is skipped when its
# stamp says it is already there). Everything lands under one prefix; nothing is installed
# over the system except `patchelf` from Debian.
#
#   tools/install_compilers.sh [PREFIX]        # default /opt/flash-compilers
#   . PREFIX/env.sh                             # exports the variables compile_check.py reads
#
# What goes where:
#   PREFIX/cuda    pip wheels (PyPI): NVRTC 13.0, CUDA headers (runtime, crt, CCCL), ptxas
#   PREFIX/trixie  Debian trixie .debs unpacked: clang-17, lld-17, ROCm device libraries,
#                  and trixie's own libc/libstdc++ (clang-17 needs glibc >= 2.38; bookworm
#                  has 2.36). clang and lld are patched (patchelf) to use that loader.
#   PREFIX/hip     HIP headers (libamdhip64-dev 6.x from Debian sid; trixie's 5.7.1 as a
#                  fallback, whose __hip_bfloat16 lacks arithmetic operators)
#   PREFIX/rocwmma rocWMMA headers, only if Debian ships a complete copy (see below)
#   PREFIX/apt     apt state for the trixie/sid/experimental look-ups (not the system's)
set -euo pipefail

PREFIX="${1:-${FLASH_COMPILERS_PREFIX:-/opt/flash-compilers}}"
mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"
PYTHON="${PYTHON:-python3}"
export DEBIAN_FRONTEND=noninteractive

# Pinned CUDA 13.0 wheels (cubecl-cuda is built for CUDA 13.0, CUDARC_CUDA_VERSION=13000).
CUDA_WHEELS=(
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85
)

log() { printf '[install_compilers] %s\n' "$*" >&2; }

# --- 1. CUDA: NVRTC, headers, ptxas from PyPI -------------------------------------------
install_cuda() {
  local stamp="$PREFIX/cuda/.stamp" want="${CUDA_WHEELS[*]}"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "cuda: present ($want)"
    return
  fi
  log "cuda: pip install --target $PREFIX/cuda ${CUDA_WHEELS[*]}"
  rm -rf "$PREFIX/cuda"
  "$PYTHON" -m pip install --quiet --no-deps --no-compile --disable-pip-version-check \
    --target "$PREFIX/cuda" "${CUDA_WHEELS[@]}"
  # Not needed for NVRTC + ptxas; saves ~80 MB.
  rm -f "$PREFIX"/cuda/nvidia/cu13/bin/{nvcc,nvlink,cudafe++,fatbinary,bin2c,__nvcc_device_query} \
    "$PREFIX"/cuda/nvidia/cu13/lib/*.a
  test -x "$PREFIX/cuda/nvidia/cu13/bin/ptxas"
  test -f "$PREFIX/cuda/nvidia/cu13/lib/libnvrtc.so.13"
  echo "$want" > "$stamp"
}

# --- 2. apt state for trixie / sid / experimental (separate from the system's) ------------
APT_DIR="$PREFIX/apt"
APT_OPTS=()
setup_apt() {
  mkdir -p "$APT_DIR"/{lists/partial,cache/archives/partial,etc/sources.list.d,etc/preferences.d}
  touch "$APT_DIR/status"
  cat > "$APT_DIR/etc/sources.list" <<'EOF'
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian experimental main
EOF
  APT_OPTS=(
    -o "Dir::State=$APT_DIR" -o "Dir::State::status=$APT_DIR/status"
    -o "Dir::Cache=$APT_DIR/cache" -o "Dir::Etc::SourceList=$APT_DIR/etc/sources.list"
    -o "Dir::Etc::SourceParts=$APT_DIR/etc/sources.list.d"
    -o "Dir::Etc::Preferences=$APT_DIR/etc/preferences"
    -o "Dir::Etc::PreferencesParts=$APT_DIR/etc/preferences.d"
    -o "APT::Sandbox::User=root" -o "Debug::NoLocking=1"
  )
  if [ -z "$(find "$APT_DIR/lists" -maxdepth 1 -name '*trixie_main*Packages*' -mmin -1440 2>/dev/null)" ]; then
    log "apt: update (trixie, sid, experimental lists in $APT_DIR)"
    apt-get "${APT_OPTS[@]}" update -qq
  fi
}
alt_apt() { apt-get "${APT_OPTS[@]}" "$@"; }
alt_cache() { apt-cache "${APT_OPTS[@]}" "$@"; }
# "package=version" for each package $2... as suite $1 has it (one apt-cache call)
versions_in() {
  local suite="$1"; shift
  alt_cache madison "$@" | awk -F'|' -v s="$suite" '
    $3 ~ "debian "s"/" { gsub(/ /, "", $1); gsub(/ /, "", $2); if (!($1 in v)) { v[$1] = $2; print $1 "=" $2 } }'
}
version_in() { versions_in "$2" "$1" | sed 's/^[^=]*=//'; }
# download package $1 at version $2 into $3
fetch_deb() {
  (cd "$3" && alt_apt download -qq "$1=$2" >/dev/null)
}

# --- 3. clang-17 toolchain from trixie, unpacked beside the system ------------------------
TRIXIE_PKGS=(
  clang-17 libclang-cpp17t64 libllvm17t64 libclang-common-17-dev lld-17 rocm-device-libs-17
  libc6 libstdc++6 libgcc-s1 libz3-4 libzstd1 libxml2 libedit2 libffi8 libtinfo6 zlib1g
  liblzma5 libbsd0 libmd0
)
install_clang17() {
  local root="$PREFIX/trixie" stamp="$PREFIX/trixie/.stamp" want p
  want="$(versions_in trixie "${TRIXIE_PKGS[@]}" | sort | tr '\n' ' ')"
  for p in "${TRIXIE_PKGS[@]}"; do
    [[ " $want" == *" $p="* ]] || { log "trixie: no $p"; exit 1; }
  done
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "clang-17: present"
    return
  fi
  if ! command -v patchelf >/dev/null; then
    apt-get install -y -qq --no-install-recommends patchelf >/dev/null ||
      { apt-get update -qq && apt-get install -y -qq --no-install-recommends patchelf >/dev/null; }
  fi
  log "clang-17: downloading ${#TRIXIE_PKGS[@]} trixie packages"
  rm -rf "$root" "$PREFIX/debs-trixie"
  mkdir -p "$root" "$PREFIX/debs-trixie"
  for p in $want; do fetch_deb "${p%%=*}" "${p#*=}" "$PREFIX/debs-trixie"; done
  for d in "$PREFIX"/debs-trixie/*.deb; do dpkg-deb -x "$d" "$root"; done
  rm -rf "$PREFIX/debs-trixie"
  local lib="$root/usr/lib/x86_64-linux-gnu" bin="$root/usr/lib/llvm-17/bin"
  # The trixie loader and an RPATH (not RUNPATH: it must reach indirect dependencies too)
  # so that nothing of bookworm's glibc is mixed in.
  for f in "$bin/clang" "$bin/lld"; do
    patchelf --set-interpreter "$lib/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$lib" "$f"
  done
  for f in "$lib/libLLVM-17.so.1" "$root/usr/lib/llvm-17/lib/libclang-cpp.so.17"; do
    f="$(readlink -f "$f")"
    patchelf --force-rpath --set-rpath "$lib" "$f"
  done
  "$bin/clang++" --version >&2
  "$bin/ld.lld" --version >&2
  test -f "$root/usr/lib/llvm-17/lib/clang/17/amdgcn/bitcode/ockl.bc"
  echo "$want" > "$stamp"
}

# --- 4. HIP headers -------------------------------------------------------------------
install_hip_headers() {
  local v suite=sid stamp="$PREFIX/hip/.stamp"
  v="$(version_in libamdhip64-dev sid)"
  # clang-17 compiles HIP 5.7 and 6.x headers; HIP 7 headers use builtins of clang >= 20.
  if [[ ! "$v" =~ ^6\. ]]; then
    log "hip: sid has libamdhip64-dev '$v', not 6.x; using trixie's"
    suite=trixie
    v="$(version_in libamdhip64-dev trixie)"
  fi
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "libamdhip64-dev=$v" ]; then
    log "hip headers: present ($v)"
    return
  fi
  log "hip headers: libamdhip64-dev $v ($suite)"
  rm -rf "$PREFIX/hip" "$PREFIX/debs-hip"
  mkdir -p "$PREFIX/hip" "$PREFIX/debs-hip"
  fetch_deb libamdhip64-dev "$v" "$PREFIX/debs-hip"
  dpkg-deb -x "$PREFIX"/debs-hip/*.deb "$PREFIX/debs-hip/x"
  mv "$PREFIX/debs-hip/x/usr/include" "$PREFIX/hip/include"
  cp "$PREFIX/debs-hip/x/usr/share/doc/libamdhip64-dev/copyright" "$PREFIX/hip/copyright" 2>/dev/null || true
  rm -rf "$PREFIX/debs-hip"
  test -f "$PREFIX/hip/include/hip/hip_runtime.h"
  echo "libamdhip64-dev=$v" > "$stamp"
}

# --- 5. rocWMMA (header-only, MIT) ----------------------------------------------------
# Debian experimental has librocwmma-dev, but 7.2.4-1~exp1 leaves out include/rocwmma/
# internal/ (debian/not-installed), so rocwmma.hpp cannot be compiled from it. Taken only
# when complete; otherwise compile_check.py reports rocWMMA sources as unverified.
install_rocwmma() {
  local v stamp="$PREFIX/rocwmma/.stamp"
  v="$(alt_cache madison librocwmma-dev | awk -F'|' 'NR==1 {gsub(/ /,"",$2); print $2}')"
  if [ -z "$v" ]; then log "rocwmma: not in Debian"; return; fi
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "librocwmma-dev=$v" ]; then
    log "rocwmma: checked ($v: $(cat "$PREFIX/rocwmma/.status"))"
    return
  fi
  rm -rf "$PREFIX/rocwmma" "$PREFIX/debs-wmma"
  mkdir -p "$PREFIX/rocwmma" "$PREFIX/debs-wmma"
  fetch_deb librocwmma-dev "$v" "$PREFIX/debs-wmma"
  dpkg-deb -x "$PREFIX"/debs-wmma/*.deb "$PREFIX/debs-wmma/x"
  if [ -f "$PREFIX/debs-wmma/x/usr/include/rocwmma/internal/mfma.hpp" ]; then
    mv "$PREFIX/debs-wmma/x/usr/include" "$PREFIX/rocwmma/include"
    echo complete > "$PREFIX/rocwmma/.status"
    log "rocwmma: librocwmma-dev $v installed"
  else
    echo "incomplete (no include/rocwmma/internal/)" > "$PREFIX/rocwmma/.status"
    log "rocwmma: librocwmma-dev $v lacks include/rocwmma/internal/: not usable"
  fi
  rm -rf "$PREFIX/debs-wmma"
  echo "librocwmma-dev=$v" > "$stamp"
}

write_env() {
  local cu="$PREFIX/cuda/nvidia/cu13" t="$PREFIX/trixie/usr/lib/llvm-17"
  {
    echo "# generated by tools/install_compilers.sh"
    echo "export FLASH_COMPILERS_PREFIX='$PREFIX'"
    echo "export NVRTC_LIB='$cu/lib/libnvrtc.so.13'"
    echo "export FC_CUDA_ROOT='$cu'"
    echo "export FC_PTXAS='$cu/bin/ptxas'"
    echo "export FC_HIP_CLANG='$t/bin/clang++'"
    echo "export FC_HIP_DEVICE_LIBS='$t/lib/clang/17/amdgcn/bitcode'"
    echo "export FC_HIP_INCLUDE='$PREFIX/hip/include'"
    if [ -d "$PREFIX/rocwmma/include" ]; then echo "export ROCWMMA_INCLUDE='$PREFIX/rocwmma/include'"; fi
  } > "$PREFIX/env.sh"
  cat "$PREFIX/env.sh"
}

start=$SECONDS
install_cuda
setup_apt
install_clang17
install_hip_headers
install_rocwmma
write_env
log "done in $((SECONDS - start)) s; prefix $PREFIX ($(du -sh "$PREFIX" | cut -f1))"

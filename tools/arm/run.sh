#!/usr/bin/env bash
# Build dynar for aarch64 and run its kernel and model parity tests under qemu-user emulation
# on an x86-64 Debian host (see docs/ARM.md for timings and results).
#
#   sudo tools/arm/run.sh            # everything; re-runs reuse the cached rootfs and venv
#
# Stages (each is skipped when its result is already there):
#   host     apt-get install qemu-user-static binfmt-support debootstrap; register binfmt aarch64
#   rootfs   debootstrap --arch=arm64 --foreign + --second-stage under qemu (Debian bookworm,
#            python 3.11, gcc 12) into $DYNAR_ARM_ROOT
#   pydeps   aarch64 wheels (numpy scipy Cython threadpoolctl Pillow simplejpeg pytest hypothesis
#            setuptools torch)
#            installed into the rootfs venv by the *host's* pip (--platform/--target: no emulation)
#   copy     the repo's working tree (tracked + untracked, not ignored) -> $ROOT/work/dynar
#   build    DYNAR_NO_MPI=1 python setup.py build_ext --inplace, natively inside the chroot
#   checks   `file` on the built .so, platform.machine(), include/fpmode.h FPCR path compiled+run
#   tests    python -m pytest on the kernel and model parity tests, inside the chroot
#
# Environment:
#   DYNAR_ARM_ROOT=/path        rootfs location (default /var/cache/dynar-arm/rootfs)
#   DYNAR_ARM_SUITE=bookworm    Debian release for the rootfs
#   DYNAR_ARM_MIRROR=URL        Debian mirror (default: the host's apt mirror, else deb.debian.org)
#   DYNAR_ARM_TORCH=2.13.0      torch version for the parity tests; 0 = no torch (they then skip)
#   DYNAR_ARM_TESTS="tests/…"   test files (default: the kernel and model parity tests below)
#   DYNAR_ARM_PYTEST_ARGS=…     extra pytest arguments, e.g. "-k 'not resnet'" or "-x"
#   DYNAR_ARM_JOBS=N            parallel compile jobs for build_ext (default: nproc)
#   DYNAR_ARM_PORTABLE=auto|0|1 build with DYNAR_PORTABLE=1 (auto: only if gcc -mcpu=native fails)
#   DYNAR_ARM_QEMU_CPU=neoverse-n1  CPU model qemu emulates (see in_root below; "max" breaks torch)
#   DYNAR_ARM_STAGES="…"        run only these stages (default: all, in the order above)
#   DYNAR_ARM_NICE=0            don't wrap heavy commands in `nice -n 19 ionice -c3`
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=/var/cache/dynar-arm
ROOT=${DYNAR_ARM_ROOT:-$CACHE/rootfs}
SUITE=${DYNAR_ARM_SUITE:-bookworm}
TORCH=${DYNAR_ARM_TORCH:-2.13.0}
JOBS=${DYNAR_ARM_JOBS:-$(nproc)}
PORTABLE=${DYNAR_ARM_PORTABLE:-auto}
STAGES=${DYNAR_ARM_STAGES:-host rootfs pydeps copy build checks tests}
TESTS=${DYNAR_ARM_TESTS:-tests/test_conv.py tests/test_winograd.py tests/test_direct.py tests/test_tapgemm.py \
tests/test_pool.py tests/test_activation.py tests/test_linear.py tests/test_batchnorm.py \
tests/test_loss.py tests/test_sgd.py tests/test_threads.py tests/test_nn.py tests/test_models.py}
PYTEST_ARGS=${DYNAR_ARM_PYTEST_ARGS:-}
QEMU_CPU_MODEL=${DYNAR_ARM_QEMU_CPU:-neoverse-n1}
VENV=/opt/dynar-venv          # inside the rootfs
WORK=/work/dynar              # inside the rootfs
LOGDIR=$ROOT/../logs
if [[ ${DYNAR_ARM_NICE:-1} == 0 ]]; then NICE=(); else NICE=(nice -n 19 ionice -c3); fi

say()  { printf '\033[1m[arm] %s\033[0m\n' "$*" >&2; }
die()  { printf '\033[31m[arm] ERROR: %s\033[0m\n' "$*" >&2; exit 1; }
want() { [[ " $STAGES " == *" $1 "* ]]; }

[[ $(id -u) == 0 ]] || die "run as root (debootstrap, chroot and mount need it)"
[[ $(uname -m) == x86_64 || $(uname -m) == aarch64 ]] || die "unsupported host $(uname -m)"

# ---------------------------------------------------------------- timing + summary
declare -a SUMMARY=()
T_STAGE=0
stage_begin() { T_STAGE=$SECONDS; say "== $1"; }
stage_end()   { local d=$((SECONDS - T_STAGE)); SUMMARY+=("$(printf '%-8s %5ds  %s' "$1" "$d" "$2")"); say "-- $1: $2 (${d}s)"; }
print_summary() {
    ((${#SUMMARY[@]})) || return 0
    printf '\n[arm] summary (rootfs %s)\n' "$ROOT" >&2
    printf '  %s\n' "${SUMMARY[@]}" >&2
}

# ---------------------------------------------------------------- chroot mounts, undone on exit
MOUNTED=()
mount_once() {  # mount_once TARGET mount-args...
    local target=$1; shift
    mountpoint -q "$target" && return 0
    mkdir -p "$target"
    mount "$@" "$target"
    MOUNTED+=("$target")
}
cleanup() {
    local rc=$? i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" 2>/dev/null \
            || echo "[arm] warning: could not unmount ${MOUNTED[i]}" >&2
    done
    MOUNTED=()
    print_summary
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

chroot_mounts() {
    # Only fresh filesystems on the rootfs' own directories: a bind of the host's /dev could
    # propagate the submounts below back onto the host's /dev/shm and /dev/pts.
    mount_once "$ROOT/proc" -t proc proc
    # No /sys on purpose: with the x86 host's sysfs visible, torch's oneDNN (xbyak_aarch64) looks
    # for cpu0/regs/identification/midr_el1, doesn't find it and `import torch` segfaults under
    # qemu. Without /sys, cpuinfo prints two "Error in cpuinfo" lines and torch works.
    mount_once "$ROOT/dev/pts" -t devpts devpts -o newinstance,ptmxmode=0666
    mount_once "$ROOT/dev/shm" -t tmpfs tmpfs -o mode=1777,size=2g
    local n
    for n in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do   # debootstrap made these, normally
        [[ -e $ROOT/dev/${n%%:*} ]] || { IFS=: read -r name ma mi <<< "$n"; mknod -m 666 "$ROOT/dev/$name" c "$ma" "$mi"; }
    done
    cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
}

# Run a command inside the rootfs with a clean environment (no host PIP_*, OPENBLAS_*, ...).
# QEMU_CPU: qemu's default "max" CPU has SVE/SVE2/SME, and under it torch 2.13's float32
# conv2d input gradient comes out wrong (errors ~1 against a float64 reference; dynar's is
# right). cortex-a72 (ARMv8.0-A + NEON, like the FT-2000+'s FTC662 cores) builds and runs dynar,
# but torch's conv2d backward dies there with SIGILL. neoverse-n1 (ARMv8.2-A, no SVE) runs both.
in_root() {
    "${NICE[@]}" chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
        QEMU_CPU="$QEMU_CPU_MODEL" \
        PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}

# ---------------------------------------------------------------- stage: host
host_mirror() {
    [[ -n ${DYNAR_ARM_MIRROR:-} ]] && { echo "$DYNAR_ARM_MIRROR"; return; }
    local uri
    uri=$( { grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
             grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                 | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; break}}'
           } | grep -E '/debian/?$' | head -n1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

binfmt_ok() { [[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]] && grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64; }

stage_host() {
    stage_begin host
    local missing=() p
    for p in qemu-user-static binfmt-support debootstrap file rsync; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if ((${#missing[@]})); then
        say "installing host packages: ${missing[*]}"
        "${NICE[@]}" apt-get update -q
        DEBIAN_FRONTEND=noninteractive "${NICE[@]}" apt-get install -y -q "${missing[@]}"
    fi
    if [[ $(uname -m) == x86_64 ]] && ! binfmt_ok; then
        if [[ ! -e /proc/sys/fs/binfmt_misc/register ]]; then
            say "mounting binfmt_misc"
            mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
                || die "cannot mount binfmt_misc (container without the privilege?)"
        fi
        say "registering qemu-aarch64 with binfmt_misc"
        update-binfmts --enable qemu-aarch64 2>/dev/null || true
        if ! binfmt_ok; then   # write the entry ourselves ('F': interpreter opened now, works in chroots)
            echo ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
                > /proc/sys/fs/binfmt_misc/register || true
        fi
        binfmt_ok || die "binfmt_misc has no enabled qemu-aarch64 entry"
    fi
    stage_end host "qemu $(qemu-aarch64-static --version | head -n1 | awk '{print $3}'), binfmt: $(tr '\n' ' ' < /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null | awk '{print $1, $3, $5, $6}')"
}

# ---------------------------------------------------------------- stage: rootfs
stage_rootfs() {
    stage_begin rootfs
    if [[ -e $ROOT/.dynar-rootfs-ok ]]; then
        stage_end rootfs "cached ($(cat "$ROOT/.dynar-rootfs-ok"))"; return
    fi
    local mirror; mirror=$(host_mirror)
    if [[ ! -e $ROOT/.dynar-stage1-ok ]]; then
        say "debootstrap --foreign $SUITE arm64 from $mirror into $ROOT"
        rm -rf "$ROOT"; mkdir -p "$ROOT"
        "${NICE[@]}" debootstrap --arch=arm64 --foreign --variant=minbase \
            --include=build-essential,python3,python3-dev,python3-venv,file,ca-certificates \
            "$SUITE" "$ROOT" "$mirror"
        touch "$ROOT/.dynar-stage1-ok"
    fi
    # With binfmt's F flag the host interpreter is used as is; the copy covers entries without it.
    [[ -x $ROOT/usr/bin/qemu-aarch64-static ]] || cp /usr/bin/qemu-aarch64-static "$ROOT/usr/bin/"
    say "debootstrap --second-stage (runs arm64 dpkg under qemu: slow)"
    "${NICE[@]}" chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C \
        /debootstrap/debootstrap --second-stage
    echo "deb $mirror $SUITE main" > "$ROOT/etc/apt/sources.list"
    local info
    info="$SUITE, $(chroot "$ROOT" /usr/bin/python3 --version), $(chroot "$ROOT" /usr/bin/gcc -dumpfullversion) gcc, $(chroot "$ROOT" /usr/bin/uname -m)"
    echo "$info" > "$ROOT/.dynar-rootfs-ok"
    stage_end rootfs "created: $info"
}

# ---------------------------------------------------------------- stage: pydeps
stage_pydeps() {
    stage_begin pydeps
    [[ -e $ROOT/.dynar-rootfs-ok ]] || die "no rootfs at $ROOT (run the rootfs stage)"
    chroot_mounts
    local pyver glibc site reqs stamp plats=() v
    pyver=$(chroot "$ROOT" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    glibc=$(chroot "$ROOT" /usr/bin/getconf GNU_LIBC_VERSION | awk '{print $2}')
    site=$ROOT$VENV/lib/python$pyver/site-packages
    reqs="numpy scipy Cython threadpoolctl Pillow simplejpeg pytest hypothesis setuptools"
    [[ $TORCH != 0 ]] && reqs+=" torch==$TORCH"
    stamp="$pyver glibc$glibc $reqs"
    if [[ -e $ROOT$VENV/.dynar-deps && $(cat "$ROOT$VENV/.dynar-deps") == "$stamp" ]]; then
        stage_end pydeps "cached ($reqs)"; return
    fi
    rm -rf "${ROOT:?}$VENV"
    in_root /usr/bin/python3 -m venv --without-pip "$VENV"
    # pip(1) doesn't widen a manylinux_2_N platform to older glibcs: list them all.
    for ((v = ${glibc#2.}; v >= 17; v--)); do plats+=(--platform "manylinux_2_${v}_aarch64"); done
    plats+=(--platform manylinux2014_aarch64)
    say "host pip -> aarch64 wheels for cp${pyver/./} into $site: $reqs"
    # The host's own pip runs natively; --only-binary keeps everything to prebuilt aarch64 wheels.
    # (torch's aarch64 wheel on PyPI is the CUDA build: its nvidia-* dependencies come along,
    # ~3 GB; they are only loaded, never used.)
    # shellcheck disable=SC2086
    "${NICE[@]}" env -u PIP_TARGET -u PIP_PREFIX python3 -m pip install --quiet --no-compile \
        --disable-pip-version-check --no-warn-conflicts --no-warn-script-location \
        --root-user-action=ignore --target "$site" "${plats[@]}" --python-version "$pyver" \
        --implementation cp --abi "cp${pyver/./}" --only-binary=:all: $reqs \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
    echo "$stamp" > "$ROOT$VENV/.dynar-deps"
    stage_end pydeps "installed: $(in_root python -c 'import numpy, scipy, Cython; print("numpy", numpy.__version__, "scipy", scipy.__version__, "Cython", Cython.__version__)')"
}

# ---------------------------------------------------------------- stage: copy
stage_copy() {
    stage_begin copy
    mkdir -p "$ROOT$WORK"
    # The working tree as git sees it (tracked + untracked, minus .gitignore'd): no host .so/.c.
    git -C "$REPO" ls-files -z --cached --others --exclude-standard \
        | rsync -a --from0 --files-from=- "$REPO/" "$ROOT$WORK/"
    stage_end copy "$(git -C "$REPO" ls-files --cached --others --exclude-standard | wc -l) files -> $ROOT$WORK"
}

# ---------------------------------------------------------------- stage: build
stage_build() {
    stage_begin build
    chroot_mounts
    local portable=0 native
    if [[ $PORTABLE == auto ]]; then
        # Under qemu-user /proc/cpuinfo is the x86 host's: see whether gcc's -mcpu=native copes.
        if native=$(in_root sh -c 'echo "int x;" | gcc -mcpu=native -Q --help=target -x c - -o /dev/null 2>&1 | grep -E "^ +-mcpu=|^ +-march=" | tr -s " " | tr "\n" " "'); then
            [[ -n $native ]] || portable=1
        else
            portable=1
        fi
        if ((portable)); then
            say "gcc -mcpu=native fails under qemu: building with DYNAR_PORTABLE=1"
        else
            say "gcc -mcpu=native under qemu resolves to: ${native}"
        fi
    else
        portable=$PORTABLE
    fi
    say "python setup.py build_ext --inplace -j $JOBS (DYNAR_NO_MPI=1 DYNAR_PORTABLE=$portable) inside the chroot"
    local rc
    set +e
    in_root sh -c "cd $WORK && DYNAR_NO_MPI=1 DYNAR_PORTABLE=$portable DYNAR_BUILD_JOBS=$JOBS \
        python setup.py build_ext --inplace -j $JOBS" > "$LOGDIR/build.log" 2>&1
    rc=$?
    set -e
    grep -E '^(Compiling|\[|.*error)' "$LOGDIR/build.log" >&2 || true
    ((rc == 0)) || { tail -n 40 "$LOGDIR/build.log" >&2; die "build failed (exit $rc): see $LOGDIR/build.log"; }
    if grep -qiE '(^|[^-])warning:' "$LOGDIR/build.log"; then
        say "compiler warnings (see $LOGDIR/build.log):"; grep -iE '(^|[^-])warning:' "$LOGDIR/build.log" | sort -u | head -n 20 >&2
    fi
    stage_end build "DYNAR_PORTABLE=$portable, $(ls "$ROOT$WORK"/dynar/kernels/*.so | wc -l) kernel modules"
}

# ---------------------------------------------------------------- stage: checks
stage_checks() {
    stage_begin checks
    chroot_mounts
    local so bad=0
    for so in "$ROOT$WORK"/dynar/kernels/*.so; do
        if ! file -b "$so" | grep -q 'ARM aarch64'; then echo "  not aarch64: $so: $(file -b "$so")" >&2; bad=1; fi
    done
    ((bad == 0)) || die "some built modules are not aarch64"
    file -b "$(ls "$ROOT$WORK"/dynar/kernels/conv*.so)" | cut -d, -f1-3 >&2
    local mach
    mach=$(in_root sh -c "cd $WORK && python -c 'import platform, dynar.kernels.threads as t; print(platform.machine(), t.__file__.rsplit(\"/\", 1)[1])'")
    [[ $mach == aarch64\ *aarch64-linux-gnu.so ]] || die "unexpected platform/module: $mach"
    # include/fpmode.h: its aarch64 branch (mrs/msr fpcr, FZ bit 24) must be the one compiled,
    # and FZ must really flush a subnormal float32 input under this CPU (here: qemu's softfloat).
    cat > "$ROOT/tmp/fpmode_check.c" <<'EOF'
#include <stdio.h>
#include "fpmode.h"
#if !defined(__aarch64__) || !defined(DYNAR_FPCR_FZ)
#error "fpmode.h did not take its aarch64 (FPCR) path"
#endif
int main(void) {
    volatile float tiny = 1e-40f, one = 1.0f;
    float off = tiny * one;
    int set = dynar_set_flush_denormals(1), got = dynar_get_flush_denormals();
    float on = tiny * one;
    dynar_set_flush_denormals(0);
    int cleared = !dynar_get_flush_denormals();
    printf("set=%d enabled=%d cleared=%d off=%g on=%g\n", set, got, cleared, off, on);
    return !(set == 1 && got == 1 && cleared && off != 0.0f && on == 0.0f);
}
EOF
    local fp
    fp=$(in_root sh -c "gcc -O2 -Wall -Werror -I$WORK/include /tmp/fpmode_check.c -o /tmp/fpmode_check && /tmp/fpmode_check") \
        || die "fpmode.h aarch64 check failed: $fp"
    stage_end checks "$mach (QEMU_CPU=$QEMU_CPU_MODEL); fpmode.h FPCR: $fp"
}

# ---------------------------------------------------------------- stage: tests
stage_tests() {
    stage_begin tests
    chroot_mounts
    local rc line
    say "pytest under qemu: $TESTS ${PYTEST_ARGS}"
    set +e
    in_root sh -c "cd $WORK && exec python -m pytest -p no:cacheprovider -rs --durations=15 \
        --junitxml=/tmp/dynar-arm-junit.xml $TESTS $PYTEST_ARGS" 2>&1 | tee "$LOGDIR/tests.log"
    rc=${PIPESTATUS[0]}
    set -e
    cp "$ROOT/tmp/dynar-arm-junit.xml" "$LOGDIR/junit.xml" 2>/dev/null || true
    line=$(grep -E ' in [0-9.]+s' "$LOGDIR/tests.log" | tail -n1 || true)
    if [[ $rc == 0 ]]; then
        stage_end tests "OK: ${line}"
    else
        stage_end tests "FAILED (pytest exit $rc): ${line}"
        return "$rc"
    fi
}

mkdir -p "$CACHE" "$(dirname "$ROOT")"
mkdir -p "$LOGDIR"; LOGDIR=$(cd "$LOGDIR" && pwd)
say "repo $REPO -> aarch64 rootfs $ROOT (stages: $STAGES)"
T0=$SECONDS
for s in host rootfs pydeps copy build checks tests; do
    if want "$s"; then "stage_$s"; fi
done
SUMMARY+=("$(printf '%-8s %5ds' total $((SECONDS - T0)))")

"""include/plane_rows.h's im2col/col2im row loops, compiled both ways: with GCC/Clang's vector
shuffles for stride-2 rows (what this compiler builds into the kernels) and with the plain
loops that compilers without them take (DYNAR_VECTOR_SHUFFLES=0), which no kernel build here
exercises. tests/c/plane_rows_check.c does the checking, under AddressSanitizer."""
import os
import shutil
import subprocess
import sysconfig

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(os.path.dirname(HERE), "include")


def compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler {cc!r} (the one Python's extensions are built with)")
    return cc


# Float chunks of at most 16 (AVX-512 builds) or 8 (the others) elements: both are checked
# on any machine, the vectors wider than its registers emulated by the compiler.
@pytest.mark.parametrize("chunk", [16, 8])
@pytest.mark.parametrize("shuffles", [1, 0])
def test_row_loops_match_the_reference_and_stay_in_bounds(tmp_path, shuffles, chunk):
    exe = tmp_path / "plane_rows_check"
    build = subprocess.run(
        [compiler(), "-O2", "-g", "-std=c11", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=all", f"-DDYNAR_VECTOR_SHUFFLES={shuffles}",
         f"-DDYNAR_ROW_CHUNK_FLOATS={chunk}", "-I", INCLUDE,
         os.path.join(HERE, "c", "plane_rows_check.c"), "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    # The check is of bounds, not leaks; LeakSanitizer cannot run under qemu-user (the ARM
    # check), where it stops the program with a fatal error of its own.
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(f"vector shuffles {shuffles}: "), run.stdout

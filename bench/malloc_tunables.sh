# Sourced by the benches whose contenders train LibTorch models (bench/ddp.sh, bench/pipeline.sh).
#
# glibc's malloc, left to itself, gives the heap back to the kernel (trim) and takes it again every
# step in some workers and not in others, depending on what each allocated before: such a worker
# spends half its time in page faults (minor faults at ~50k/s, half the CPU in the kernel), and the
# CNN's step then took 26-31 ms instead of 9 in any contender, `local` included, run after run
# (bench/RESULTS.md, 2026-11-27 18:10). Every contender, PyTorch's Python included, therefore runs
# with the same tunables that keep the heap: a trim threshold of 1 GiB, and tensors up to 32 MiB
# from the heap rather than from fresh mmaps. GLIBC_TUNABLES set by the caller wins (empty: glibc's
# defaults).
export GLIBC_TUNABLES=${GLIBC_TUNABLES-glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432}

#!/bin/bash
# The installed copy, as a user gets it (docs/getting-started.md).
#
#   install_test.sh install BUILD_DIR SOURCE_DIR
#     `cmake --install` into a temporary prefix; a program outside the tree (tests/consumer)
#     built with find_package(shoal) against it runs under that prefix's `shoal run -n 2` and
#     must train as one process; docs/getting-started.md's program, compiled with
#     `pkg-config --cflags --libs shoal`, runs and learns. Both load the installed libshoal. The
#     installed Python package, imported from the prefix by two workers of /usr/bin/python3, too.
#   install_test.sh deb BUILD_DIR SOURCE_DIR
#     `cpack -G DEB` makes shoal, shoal-dev and python3-shoal packages; their contents are what `cmake
#     --install` installs under /usr, their Depends name the Debian package of every library
#     the runtime's files link, and the packed .pc file points into /usr.
#
# Exits 77 (ctest's skip) when a tool it needs is missing, with a message saying which.
set -euo pipefail

mode=$1 build=$(realpath "$2") source=$(realpath "$3")
work=$(mktemp -d /tmp/shoal-install-test-XXXXXX)
trap 'rm -rf "$work"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null ||
      { echo "SKIP: $tool is not installed (scripts/setup.sh installs it)"; exit 77; }
  done
}
# Every wait has a deadline: a hung step fails the test instead of holding ctest.
run() { timeout --kill-after=10 "$@"; }
# Fails unless program $1 loads libshoal from directory $2.
loads_shoal_from() {
  local found
  found=$(ldd "$1" | awk '/libshoal\.so/ { print $3 }')
  [[ -n $found && $(dirname "$(realpath "$found")") == "$(realpath "$2")" ]] ||
    { ldd "$1" | grep shoal; fail "$1 loads libshoal from '$found', not from $2"; }
}

install_mode() {
  need cmake ninja pkg-config g++ ldd
  local prefix=$work/prefix
  run 120 cmake --install "$build" --prefix "$prefix" >"$work/install.log" ||
    { cat "$work/install.log"; fail "cmake --install"; }
  local libdir
  libdir=$(dirname "$(find "$prefix" -name 'libshoal.so' | head -1)")
  [[ -n $libdir && -x $prefix/bin/shoal && -x $prefix/bin/shoal-run ]] ||
    fail "no libshoal.so, bin/shoal or bin/shoal-run under $prefix"
  for f in include/shoal/shoal.h include/shoal/global/ops.h; do
    [[ -f $prefix/$f ]] || fail "$f was not installed"
  done
  [[ -f $libdir/cmake/shoal/shoalConfig.cmake && -f $libdir/pkgconfig/shoal.pc ]] ||
    fail "no CMake package or pkg-config file under $libdir"

  # The installed command finds the installed library (its RUNPATH), not the build tree's:
  # `shoal run` is shoal-run's (src/launch/CMakeLists.txt); `shoal` itself loads no libshoal.
  loads_shoal_from "$prefix/bin/shoal-run" "$libdir"

  # Compiles go through ccache when there is one, with paths relative to $work so that a later
  # run hits the cache: two LibTorch translation units are most of this test's time.
  local launcher=()
  if command -v ccache >/dev/null; then
    launcher=(ccache)
    export CCACHE_BASEDIR=$work CCACHE_NOHASHDIR=true
  fi

  # find_package(shoal), with only the prefix given.
  local consumer=$work/consumer
  run 600 cmake -S "$source/tests/consumer" -B "$consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER="${launcher[0]}"} \
    >"$work/configure.log" 2>&1 ||
    { cat "$work/configure.log"; fail "configuring tests/consumer against $prefix"; }
  run 600 cmake --build "$consumer" >"$work/build.log" 2>&1 ||
    { cat "$work/build.log"; fail "building tests/consumer against $prefix"; }
  loads_shoal_from "$consumer/train" "$libdir"
  local out
  out=$(cd "$work" && run 120 "$prefix/bin/shoal" run -n 2 "$consumer/train" 2>&1) ||
    { echo "$out"; fail "shoal run -n 2 train"; }
  echo "$out"
  for r in 0 1; do
    grep -q "consumer: worker $r of 2: 2 steps, parameters as one process, global matmul as one \
process" <<<"$out" ||
      fail "worker $r did not train as one process"
  done

  # The Python package (docs/python.md), when the build made it: the installed shoal._C loads the
  # installed libshoal, and a job of two of Debian's python3 imports it from the prefix.
  if compgen -G "$build/python/shoal/_C*.so" >/dev/null; then
    local pydir=$prefix/lib/python3/dist-packages extension
    extension=$(compgen -G "$pydir/shoal/_C*.so" | head -1) ||
      fail "no shoal/_C*.so under $pydir"
    [[ -f $pydir/shoal/__init__.py && -f $pydir/shoal/dp.py ]] || fail "no Python modules under $pydir/shoal"
    loads_shoal_from "$extension" "$libdir"
    out=$(cd "$work" && PYTHONPATH=$pydir run 120 "$prefix/bin/shoal" run -n 2 /usr/bin/python3 -c '
import os, torch, shoal
shoal.init()
t = torch.ones(2)
shoal.comm.world().all_reduce(t)
print("python: worker %d of %d: all_reduce %s, shoal from %s" % (shoal.rank(), shoal.world_size(), t.tolist(),
      os.path.dirname(shoal.__file__)))
' 2>&1) || { echo "$out"; fail "shoal run -n 2 python3 with the installed package"; }
    echo "$out"
    for r in 0 1; do
      grep -q "python: worker $r of 2: all_reduce \[2.0, 2.0\], shoal from $pydir/shoal" <<<"$out" ||
        fail "worker $r did not import the installed package and all-reduce"
    done
  fi

  # pkg-config, with only PKG_CONFIG_PATH given.
  local flags
  flags=$(PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --cflags --libs shoal) ||
    fail "pkg-config --cflags --libs shoal"
  echo "pkg-config: $flags"
  for want in "-I$prefix/include" "-L$libdir" -lshoal -DUSE_C10D_GLOO -ltorch -lc10; do
    [[ " $flags " == *" $want "* ]] || fail "pkg-config gives no $want: $flags"
  done
  # docs/getting-started.md's program, compiled with those flags as the page says, as strict C++17.
  awk '/tests\/install_test.sh builds this program/ { marked = 1; next }
       marked && /^```cpp/ { inside = 1; next }
       inside && /^```/ { exit }
       inside { print }' "$source/docs/getting-started.md" >"$work/train.cpp"
  [[ -s $work/train.cpp ]] || fail "no marked program in docs/getting-started.md"
  # shellcheck disable=SC2086  # the flags are words
  # -pedantic-errors: the page promises plain C++17 (no designated initializers, which are C++20).
  (cd "$work" && run 600 "${launcher[@]}" g++ -std=c++17 -pedantic-errors -O1 train.cpp \
    -o train $flags -Wl,-rpath,"$libdir") ||
    fail "compiling docs/getting-started.md's program with pkg-config's flags"
  loads_shoal_from "$work/train" "$libdir"
  out=$(cd "$work" && run 120 "$prefix/bin/shoal" run -n 2 "$work/train" 2>&1) ||
    { echo "$out"; fail "shoal run -n 2 on docs/getting-started.md's program"; }
  echo "$out"
  # Printed by the main worker only, and it learns: y = 3x - 1 is fitted far below its variance.
  [[ $(grep -c '^\[0\] epoch [0-4]: loss' <<<"$out") == 5 ]] ||
    fail "expected 5 epochs from worker 0"
  ! grep -q '^\[1\]' <<<"$out" || fail "worker 1 printed"
  local last
  last=$(sed -n 's/^\[0\] epoch 4: loss //p' <<<"$out")
  awk -v loss="$last" 'BEGIN { exit !(loss < 0.5) }' || fail "the loss after 5 epochs is $last"
}

deb_mode() {
  need cpack dpkg-deb dpkg-query ldd pkg-config
  local debs=$work/debs
  mkdir -p "$debs"
  (cd "$build" && run 600 cpack -G DEB -B "$debs") >"$work/cpack.log" 2>&1 ||
    { cat "$work/cpack.log"; fail "cpack -G DEB"; }
  local runtime dev
  runtime=$(ls "$debs"/shoal_*.deb) dev=$(ls "$debs"/shoal-dev_*.deb) ||
    fail "cpack made $(ls "$debs"), expected shoal_*.deb and shoal-dev_*.deb"
  echo "packages: $(basename "$runtime") $(basename "$dev")"

  # The files, by package.
  dpkg-deb --contents "$runtime" >"$work/runtime.txt"
  dpkg-deb --contents "$dev" >"$work/dev.txt"
  for f in ./usr/bin/shoal ./usr/bin/shoal-run ./usr/bin/shoal-slurm-step "./usr/lib/libshoal.so.[0-9]"; do
    grep -q " $f" "$work/runtime.txt" || { cat "$work/runtime.txt"; fail "shoal has no $f"; }
  done
  for f in ./usr/include/shoal/shoal.h ./usr/include/shoal/global/ops.h \
    ./usr/lib/cmake/shoal/shoalConfig.cmake ./usr/lib/cmake/shoal/shoalTargets.cmake \
    ./usr/lib/cmake/shoal/shoalTorch.cmake ./usr/lib/pkgconfig/shoal.pc \
    "./usr/lib/libshoal.so ->"; do
    grep -q " $f" "$work/dev.txt" || { cat "$work/dev.txt"; fail "shoal-dev has no $f"; }
  done
  ! grep -q "include/" "$work/runtime.txt" || fail "shoal has headers; they belong in shoal-dev"

  # Depends: the packages of the libraries the runtime's files need, no more and no fewer.
  local depends version
  depends=$(dpkg-deb --field "$runtime" Depends)
  version=$(dpkg-deb --field "$runtime" Version)
  echo "shoal Depends: $depends"
  local unpacked=$work/unpacked
  dpkg-deb -x "$runtime" "$unpacked"
  dpkg-deb -x "$dev" "$unpacked"
  local needed=()
  for f in "$unpacked/usr/bin/shoal" "$unpacked"/usr/lib/libshoal.so.*.*; do
    while read -r lib; do needed+=("$lib"); done < <(objdump -p "$f" | awk '/NEEDED/ { print $2 }')
  done
  declare -A path_of
  while read -r name path; do path_of[$name]=$path; done < <(
    for f in "$unpacked/usr/bin/shoal" "$unpacked"/usr/lib/libshoal.so.*.*; do
      # "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)", or the loader's
      # "/lib64/ld-linux-x86-64.so.2 (0x...)"
      LD_LIBRARY_PATH=$unpacked/usr/lib ldd "$f" |
        awk '/=> \// { print $1, $3 } $1 ~ /^\// { n = split($1, part, "/"); print part[n], $1 }'
    done)
  local owners=()
  for lib in $(printf '%s\n' "${needed[@]}" | sort -u); do
    [[ $lib == libshoal.so* ]] && continue
    local path=${path_of[$lib]:-}
    [[ -n $path ]] || fail "cannot resolve $lib, which the packed files need"
    local package
    package=$(dpkg-query -S "$(realpath "$path")" 2>/dev/null ||
      dpkg-query -S "$path" 2>/dev/null ||
      dpkg-query -S "/usr$path" 2>/dev/null || true)
    package=${package%%:*}
    [[ -n $package ]] || fail "no Debian package owns $path ($lib)"
    [[ ", $depends," == *", $package,"* || ", $depends," == *", $package "* ]] ||
      fail "$lib comes from $package, which shoal's Depends ($depends) does not name"
    echo "  $lib: $package"
    owners+=("$package")
  done
  local named
  for named in ${depends//,/ }; do
    [[ " ${owners[*]} " == *" $named "* ]] ||
      fail "shoal's Depends name $named, which provides none of the libraries the files load"
  done
  local dev_depends
  dev_depends=$(dpkg-deb --field "$dev" Depends)
  echo "shoal-dev Depends: $dev_depends"
  for want in "shoal (= $version)" libtorch-dev libgloo-dev; do
    [[ $dev_depends == *"$want"* ]] || fail "shoal-dev's Depends ($dev_depends) do not name $want"
  done

  # python3-shoal, when the build made the Python package: its files, and its Depends.
  if compgen -G "$build/python/shoal/_C*.so" >/dev/null; then
    local python
    python=$(ls "$debs"/python3-shoal_*.deb) || fail "cpack made no python3-shoal package"
    dpkg-deb --contents "$python" >"$work/python.txt"
    for f in ./usr/lib/python3/dist-packages/shoal/__init__.py "./usr/lib/python3/dist-packages/shoal/_C."; do
      grep -q " $f" "$work/python.txt" || { cat "$work/python.txt"; fail "python3-shoal has no $f"; }
    done
    local python_depends
    python_depends=$(dpkg-deb --field "$python" Depends)
    echo "python3-shoal Depends: $python_depends"
    for want in "shoal (= $version)" python3-torch "python3 (>= 3."; do
      [[ $python_depends == *"$want"* ]] || fail "python3-shoal's Depends ($python_depends) do not name $want"
    done
  fi

  # The packed pkg-config file points into /usr, where apt installs the package.
  grep -qx "prefix=/usr" "$unpacked/usr/lib/pkgconfig/shoal.pc" ||
    { cat "$unpacked/usr/lib/pkgconfig/shoal.pc"; fail "the packed shoal.pc's prefix is not /usr"; }
}

case $mode in
  install) install_mode ;;
  deb) deb_mode ;;
  *) fail "unknown mode '$mode'; expected install or deb" ;;
esac
echo "PASS"

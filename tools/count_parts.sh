#!/usr/bin/env bash
# How well the device's parts keep their state to themselves (issue 41, item 1), counted over
# csrc/core with ctags and grep:
#   friends      `friend class DeviceAllocator` in the core (the facade reaching into DeviceCore)
#   reaches      uses in core/device_allocator.{h,cpp} of DeviceCore's private members (`core_.<private>`)
#   fields       public data members of DeviceState (the state the parts share)
#   field uses   uses of those fields in csrc/core and csrc/sharing (`d.<field>`, `d_.<field>`)
#   bumps        statistics counters (num_*) changed by hand outside core/stats.{h,cpp}
#   outside writes  public data members of csrc/core and csrc/sharing types written outside the
#                type's own files (tools/count_writes.py, by type: `python3 tools/count_writes.py -v`)
# Usage: tools/count_parts.sh [ROOT]  (needs Universal Ctags; clang-query for the last line)
set -uo pipefail  # not -e: a grep that finds nothing is a count of 0
cd "${1:-$(dirname "$0")/..}"

members() {  # members CLASS ACCESS FILE: the names of CLASS's members of ACCESS (public/private)
  ctags -f - --c++-kinds=mfp --fields=+aK --language-force=C++ "$3" |
    awk -F'\t' -v cls="$1" -v acc="access:$2" '{ ok = 0; for (i = 4; i <= NF; i++) { if ($i == "class:gpumem::" cls || $i == "struct:gpumem::" cls) ok++; if ($i == acc) ok++ } if (ok == 2) print $1 }' |
    sort -u
}

friends=$(grep -cE '^\s*friend class DeviceAllocator' csrc/core/*.h | awk -F: '{ s += $2 } END { print s + 0 }')
private=$(members DeviceCore private csrc/core/device_core.h | paste -sd'|')
reaches=0
[ -n "$private" ] && reaches=$({ grep -ohE "core_\.($private)\b" csrc/core/device_allocator.h csrc/core/device_allocator.cpp || true; } | wc -l)
fields=$(ctags -f - --c++-kinds=m --fields=+aK --language-force=C++ csrc/core/device_state.h |
  awk -F'\t' '/struct:gpumem::DeviceState/ && /access:public/ { print $1 }' | sort -u)
nfields=$(printf '%s\n' "$fields" | grep -c . || true)
uses=0
if [ "$nfields" -gt 0 ]; then
  uses=$({ grep -rohE "\bd_?\.($(printf '%s\n' "$fields" | paste -sd'|'))\b" csrc/core csrc/sharing || true; } | wc -l)
fi
bumps=$(grep -rnE '(\+\+|--) *[A-Za-z_.>()-]*\bnum_[a-z_]+|\bnum_[a-z_]+ *(\+\+|--|\+=|-=)' csrc/core \
  --include='*.cpp' --include='*.h' | { grep -vE '^csrc/core/stats\.(h|cpp):' || true; } | wc -l)
echo "friends $friends"
echo "reaches $reaches"
echo "fields $nfields"
echo "field uses $uses"
echo "bumps $bumps"
if command -v clang-query >/dev/null; then
  python3 tools/count_writes.py | sed -n 1p
else
  echo "count_parts.sh: outside writes not counted: needs clang-query (Debian's clang-tools)" >&2
fi

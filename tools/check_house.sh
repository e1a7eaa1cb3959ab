#!/bin/sh
# tools/check_house.sh -- the rules of the house that a compiler does not check.
#
#   1. Layers only point down. The layer map is the LAYERS section of the
#      manual (src/dt_manual.txt, the top of dtrain.h): every file of src/ is
#      in exactly one layer, and a file may include only headers of its own
#      layer or below, and call only functions (dt_*, dt__*) defined in files
#      of its own layer or below. A call upward must go through a hook that
#      the upper layer installs (a function pointer), as the device arena does.
#   2. No file in src/ is over MAX_LINES (1000) lines.
#   3. The manual names every DTRAIN_* macro that the sources test with
#      #if/#ifdef/#ifndef/#elif/defined() and every DTRAIN_* environment
#      variable they read (include guards and DTRAIN__ private macros aside).
#
# Prints "check_house: N passed, N failed" and exits non-zero on a failure.
# Usage: sh tools/check_house.sh [SRC_DIR]   (default src)
SRC=${1:-src}
MANUAL=$SRC/dt_manual.txt
MAX_LINES=${MAX_LINES:-1000}
pass=0; fail=0
ok()  { pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }

[ -f "$MANUAL" ] || { echo "check_house: no $MANUAL"; echo "check_house: 0 passed, 1 failed"; exit 1; }

# ---- the layer map: "N name stem stem* ..." lines of the LAYERS section --------
map=$(mktemp "${TMPDIR:-/tmp}/house.XXXXXX") || exit 1
trap 'rm -f "$map" "$map".*' EXIT
awk '
  /^ \* LAYERS/ { on = 1; next }
  on && /^ \*[ ]*$/ { if (seen) exit; next }
  on && /^ \*   [0-9]+ / { seen = 1; for (i = 4; i <= NF; i++) if ($i ~ /^dt_/) print $2, $i }
' "$MANUAL" > "$map"
if [ ! -s "$map" ]; then
  bad "no LAYERS map in $MANUAL (lines ' *   N name  dt_file dt_prefix* ...')"
  echo "check_house: $pass passed, $fail failed"; exit 1
fi

# layer_of FILE: the layer of a src file by its stem; an exact stem beats a
# prefix*, a longer prefix beats a shorter one. Empty when unmapped.
layer_of() {
  awk -v f="$1" '
    { pat = $2; lay = $1
      if (pat ~ /\*$/) { p = substr(pat, 1, length(pat) - 1)
        if (substr(f, 1, length(p)) == p && length(p) > best) { best = length(p); out = lay } }
      else if (f == pat) { best = 100000; out = lay } }
    END { print out }' "$map"
}

files=$(cd "$SRC" && ls *.c *.h 2>/dev/null)
: > "$map.files"
for f in $files; do
  stem=${f%.*}
  l=$(layer_of "$stem")
  if [ -z "$l" ]; then bad "layers: src/$f is in no layer: add it to LAYERS in $MANUAL"; continue; fi
  echo "$f $l" >> "$map.files"
done
[ "$fail" -eq 0 ] && ok

# ---- includes point down --------------------------------------------------------
n_inc=0
for f in $files; do
  lf=$(awk -v f="$f" '$1 == f { print $2 }' "$map.files"); [ -n "$lf" ] || continue
  for inc in $(sed -n 's/^[ \t]*#[ \t]*include[ \t]*"\([^"]*\)".*/\1/p' "$SRC/$f"); do
    li=$(awk -v f="$inc" '$1 == f { print $2 }' "$map.files")
    [ -n "$li" ] || continue
    n_inc=$((n_inc + 1))
    if [ "$li" -gt "$lf" ]; then
      bad "layers: src/$f (layer $lf) includes $inc (layer $li)"
    fi
  done
done
ok

# ---- calls point down -------------------------------------------------------------
# Checked in the .c files and the private headers (their declarations count:
# a private header of a low layer must not declare what a higher one defines).
# The public headers group the API by object for the reader, so only their
# includes are checked.
public=$(awk '$1 == "public" { print $2 }' "$SRC/MANIFEST" 2>/dev/null | tr '\n' ' ')
# Definitions: a line starting with DTRAIN_API or DTRAIN_PRIVATE (or "static"
# is skipped: file-local) in a .c file, naming dt_x( and not ending in ';'.
# Uses: an identifier followed by '(' outside comments and string literals.
for f in $files; do case $f in *.c) ;; *) continue;; esac
  awk -v file="$f" '
    /^(DTRAIN_API|DTRAIN_PRIVATE)/ && $0 !~ /;[ \t]*$/ {
      if (match($0, /dt_[A-Za-z0-9_]*[ \t]*\(/)) {
        s = substr($0, RSTART, RLENGTH); sub(/[ \t]*\($/, "", s); print s, file } }' "$SRC/$f"
done > "$map.defs"
awk -v defs="$map.defs" -v layers="$map.files" '
  BEGIN {
    while ((getline line < layers) > 0) { split(line, a, " "); L[a[1]] = a[2] }
    while ((getline line < defs) > 0) { split(line, a, " "); if (a[2] in L) { D[a[1]] = a[2]; DL[a[1]] = L[a[2]] } }
  }
  FNR == 1 { file = FILENAME; sub(/.*\//, "", file); lf = L[file]; incom = 0 }
  {
    s = $0; out = ""
    # strip comments (block comments may span lines) and string/char literals
    while (s != "") {
      if (incom) { e = index(s, "*/"); if (!e) { s = ""; break } s = substr(s, e + 2); incom = 0; continue }
      b = index(s, "/*"); c = index(s, "//"); q = index(s, "\"")
      m = 0; if (b && (!m || b < m)) m = b; if (c && (!m || c < m)) m = c; if (q && (!m || q < m)) m = q
      if (!m) { out = out s; break }
      out = out substr(s, 1, m - 1)
      if (m == b) { s = substr(s, m + 2); incom = 1 }
      else if (m == c) { s = "" }
      else { s = substr(s, m + 1); while (1) { e = index(s, "\""); if (!e) { s = ""; break }
               if (e > 1 && substr(s, e - 1, 1) == "\\" && !(e > 2 && substr(s, e - 2, 1) == "\\")) { s = substr(s, e + 1); continue }
               s = substr(s, e + 1); break } }
    }
    if (lf == "") next
    while (match(out, /dt_[A-Za-z0-9_]*[ \t]*\(/)) {
      name = substr(out, RSTART, RLENGTH); sub(/[ \t]*\($/, "", name)
      prev = RSTART > 1 ? substr(out, RSTART - 1, 1) : ""
      out = substr(out, RSTART + RLENGTH)
      if (prev ~ /[A-Za-z0-9_]/) continue
      if ((name in DL) && DL[name] > lf && !seen[file SUBSEP name]++)
        printf "FAIL layers: src/%s (layer %d) calls %s, defined in src/%s (layer %d)\n", file, lf, name, D[name], DL[name]
    }
  }' $(for f in $files; do case " $public " in *" $f "*) ;; *) echo "$SRC/$f";; esac; done) > "$map.calls"
if [ -s "$map.calls" ]; then cat "$map.calls"; fail=$((fail + $(wc -l < "$map.calls"))); else ok; fi

# ---- file sizes ---------------------------------------------------------------------
for f in $files; do
  n=$(wc -l < "$SRC/$f")
  if [ "$n" -gt "$MAX_LINES" ]; then bad "size: src/$f has $n lines (at most $MAX_LINES: split it by concept)"; fi
done
ok

# ---- the manual names every configuration macro and environment variable ------------
tested=$( (cat "$SRC"/*.c "$SRC"/*.h; [ -f dtrain_cuda.h ] && cat dtrain_cuda.h) |
  grep -E '^[ \t]*#[ \t]*(if|ifdef|ifndef|elif)' | grep -oE 'DTRAIN_[A-Z0-9_]+' |
  grep -vE '^DTRAIN__|^DTRAIN_CUDA__|_H$' | sort -u)
envs=$( (cat "$SRC"/*.c "$SRC"/*.h; [ -f dtrain_cuda.h ] && cat dtrain_cuda.h) |
  grep -oE 'getenv\("DTRAIN_[A-Z0-9_]+"\)' | grep -oE 'DTRAIN_[A-Z0-9_]+' | sort -u)
for m in $tested $envs; do
  if grep -qw "$m" "$MANUAL"; then ok; else bad "manual: $m is tested or read by the sources but not named in $MANUAL"; fi
done

echo "check_house: $pass passed, $fail failed ($n_inc includes checked)"
[ "$fail" -eq 0 ]

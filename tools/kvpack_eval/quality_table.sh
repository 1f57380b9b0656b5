#!/usr/bin/env bash
# Prints the markdown table of docs/quality.md: format × {naive, full} × outlier scale, from
# kvpack-eval --synthetic. Usage: quality_table.sh [path/to/kvpack-eval] [N:H:d] [queries] [seeds...]
set -euo pipefail
eval_bin=${1:-build/tools/kvpack_eval/kvpack-eval}
shape=${2:-4133:4:128}
queries=${3:-512}
shift $(( $# < 3 ? $# : 3 ))
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(1)

field() { sed -E "s/.*\"$1\": ([-0-9.e+]+).*/\1/" <<<"$2"; }

echo "| format | outliers | method | rel_l2 | mean cosine | 1 − mean cosine | bits/value | gain (naive/full rel_l2) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for format in int4 int8 bf16; do
  for outliers in 10 20 50; do
    declare -A rel=() cos=()
    bits=""
    for method in naive full; do
      flags=""
      [ "$method" = naive ] && flags="--no-rotate --no-smooth --no-balance"
      rel_sum=0; cos_sum=0
      for seed in "${seeds[@]}"; do
        json=$("$eval_bin" --synthetic "$shape:$outliers" --queries "$queries" --seed "$seed" --format "$format" $flags)
        rel_sum=$(awk -v a="$rel_sum" -v b="$(field rel_l2 "${json%%\"heads\": \[*}")" 'BEGIN{printf "%.12g", a+b}')
        cos_sum=$(awk -v a="$cos_sum" -v b="$(field cosine "${json%%\"heads\": \[*}")" 'BEGIN{printf "%.12g", a+b}')
        bits=$(field bits_per_value "$json")
      done
      rel[$method]=$(awk -v s="$rel_sum" -v n=${#seeds[@]} 'BEGIN{printf "%.3g", s/n}')
      cos[$method]=$(awk -v s="$cos_sum" -v n=${#seeds[@]} 'BEGIN{printf "%.7f | %.1e", s/n, 1 - s/n}')
    done
    gain=$(awk -v a="${rel[naive]}" -v b="${rel[full]}" 'BEGIN{printf "%.1f×", a/b}')
    printf "| %s | %s× | naive | %s | %s | %.3f | |\n" "$format" "$outliers" "${rel[naive]}" "${cos[naive]}" "$bits"
    printf "| %s | %s× | full | %s | %s | %.3f | %s |\n" "$format" "$outliers" "${rel[full]}" "${cos[full]}" "$bits" "$gain"
  done
done

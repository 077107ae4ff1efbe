#!/bin/sh
# Print a cluster/ YAML with its ${NAME} placeholders filled from the environment (envsubst).
# Only the file's own placeholders are replaced, so shell variables such as $RAY_HEAD_IP stay;
# an unset placeholder is an error naming it.
#   IMAGE=... BUCKET=... cluster/render.sh cluster/kuberay/rayjob-pretrain.yaml | kubectl apply -f -
# Pod sizes are not given but derived from cluster/instance-types.yaml: for each group G in HEAD,
# GPU, CPU with G_INSTANCE_TYPE set, G_POD_CPU and G_POD_MEMORY are the node's vCPUs and GiB less
# what the kubelet keeps (max(1, 10%) and max(4 GiB, 10%)); GPU_POD_GPUS is every GPU of the node,
# and the Ray Train workers (one per GPU) range from TRAIN_WORKERS_MIN = GPU_WORKERS nodes x
# GPU_POD_GPUS (on demand) to TRAIN_WORKERS = (GPU_WORKERS + SPOT_GPU_WORKERS) x GPU_POD_GPUS
# (SPOT_GPU_WORKERS: 0 unless set).
set -eu
file=${1:?usage: cluster/render.sh FILE.yaml}
table=$(dirname "$0")/instance-types.yaml
for group in HEAD GPU CPU; do
    eval "type=\${${group}_INSTANCE_TYPE:-}"
    [ -n "$type" ] || continue
    row=$(awk -v t="$type:" '$1 == t { $1 = ""; gsub(/[^0-9 ]/, ""); print }' "$table")  # "vcpu GiB gpus"
    if [ -z "$row" ]; then
        echo "render.sh: ${group}_INSTANCE_TYPE=$type is not in $table" >&2
        exit 2
    fi
    set -- $row
    export "${group}_POD_CPU=$(( $1 - ($1 > 10 ? ($1 + 9) / 10 : 1) ))"
    export "${group}_POD_MEMORY=$(( $2 - ($2 > 40 ? ($2 + 9) / 10 : 4) ))Gi"
    [ "$group" = GPU ] && export GPU_POD_GPUS="$3"
done
export SPOT_GPU_WORKERS="${SPOT_GPU_WORKERS:-0}"
if [ -n "${GPU_POD_GPUS:-}" ] && [ -n "${GPU_WORKERS:-}" ]; then
    export TRAIN_WORKERS_MIN=$(( GPU_WORKERS * GPU_POD_GPUS ))
    export TRAIN_WORKERS=$(( (GPU_WORKERS + SPOT_GPU_WORKERS) * GPU_POD_GPUS ))
fi
names=$(grep -o '\${[A-Z_][A-Z0-9_]*}' "$file" | sort -u | tr -d '${}')
missing=""
for name in $names; do
    eval "[ -n \"\${$name:-}\" ]" || missing="$missing $name"
done
if [ -n "$missing" ]; then
    echo "render.sh: $file needs these variables set:$missing" >&2
    exit 2
fi
envsubst "$(printf '${%s} ' $names)" < "$file"

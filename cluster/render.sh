#!/bin/sh
# Print a cluster/ YAML with its ${NAME} placeholders filled from the environment (envsubst).
# Only the file's own placeholders are replaced, so shell variables such as $RAY_HEAD_IP stay;
# an unset placeholder is an error naming it.
#   IMAGE=... BUCKET=... cluster/render.sh cluster/kuberay/rayjob-pretrain.yaml | kubectl apply -f -
set -eu
file=${1:?usage: cluster/render.sh FILE.yaml}
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

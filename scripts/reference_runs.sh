#!/usr/bin/env bash
# The reference runs every change must leave unchanged (non-timing metrics, bit for bit), and their comparison.
#   bash scripts/reference_runs.sh run OUT [STEPS]   # default GRPO and PPO (data-plane and legacy), async d=1, a replay
#   bash scripts/reference_runs.sh compare A B       # `relayrl diff` of each pair; exit 1 if any differs
# RAY=1 adds the 2-worker Ray config. Runs are shortened to STEPS (default 40) with the schedule horizon shortened
# alike, so a baseline and a candidate must use the same STEPS. The PPO runs use PPO_CONFIG, a frozen copy of
# configs/ppo_arith_tiny.yaml as the a928c7c baseline was made with (the shipped config was retuned since).
set -euo pipefail
cd "$(dirname "$0")/.."
RELAYRL=${RELAYRL:-.venv/bin/relayrl}
PPO_CONFIG=scripts/reference/ppo_arith_tiny_a928c7c.yaml
NAMES="grpo grpo_legacy ppo ppo_legacy grpo_async replay"
[ "${RAY:-0}" = 1 ] && NAMES="$NAMES grpo_ray"

run() {
    local out=$1 steps=${2:-40}
    [ ! -e "$out" ] || { echo "$out exists: give a new directory (an existing run directory would resume)"; exit 2; }
    mkdir -p "$out"
    export HF_HUB_OFFLINE=1
    local common=("grpo.max_num_steps=$steps" "grpo.val_period=20")
    $RELAYRL train --run-dir "$out/grpo" "${common[@]}" checkpointing.save_period=10 checkpointing.keep_top_k=null
    $RELAYRL train --run-dir "$out/grpo_legacy" "${common[@]}" data_plane.enabled=false
    $RELAYRL train --config "$PPO_CONFIG" --run-dir "$out/ppo" "ppo.max_num_steps=$steps" ppo.val_period=20
    $RELAYRL train --config "$PPO_CONFIG" --run-dir "$out/ppo_legacy" "ppo.max_num_steps=$steps" \
        ppo.val_period=20 data_plane.enabled=false
    $RELAYRL train --run-dir "$out/grpo_async" "${common[@]}" grpo.async_grpo.enabled=true \
        grpo.async_grpo.max_trajectory_age_steps=1
    $RELAYRL replay "$out/grpo" --from-step 11 --to-step 15 --out "$out/replay"
    if [ "${RAY:-0}" = 1 ]; then
        $RELAYRL train --config configs/grpo_arith_ray_2cpu.yaml --run-dir "$out/grpo_ray" "grpo.max_num_steps=$steps" \
            grpo.val_period=20
    fi
}

compare() {
    local a=$1 b=$2 bad=0
    for n in $NAMES; do
        [ -d "$a/$n" ] || continue
        flag=--all  # transport counters too, except async's, which depend on when the producer ran
        [ "$n" = grpo_async ] && flag=
        if out=$($RELAYRL diff $flag "$a/$n" "$b/$n" 2>&1); then echo "$n: $out"; else echo "$n: DIFFERS: $out"; bad=1; fi
    done
    return $bad
}

case "${1:-}" in
run) shift; run "$@" ;;
compare) shift; compare "$@" ;;
*) sed -n 2,6p "$0"; exit 2 ;;
esac

#!/bin/bash
# A SLURM job that trains to the end across time limits: 300 s before the limit SLURM signals this batch script
# (USR1), which asks train.py to stop (SIGTERM: it saves a checkpoint and exits), waits for it, and requeues the job
# (scontrol requeue), which continues from that checkpoint with --resume auto. A run that finished is not requeued.
# A requeued job that starts while the old one still holds the run folder (a requeue from outside, a node that is slow
# to die) waits for it to let the folder go (--wait-for-lock, LOCK_WAIT seconds, default 900), never races it.
#
#   sbatch scripts/slurm_train.sh CONFIG RUN_DIR [train.py options and key.sub=value overrides ...]
#   sbatch scripts/slurm_train.sh lipsformer_cswin_base runs/cswin_base --data-dir /data/imagenet --amp --amp-dtype bfloat16
#
# One task per node starts Accelerate, which starts one process per GPU (GPUS_PER_NODE, default 8). LAUNCH=local runs
# train.py in this shell's process group instead of srun + accelerate launch (one machine, or a test without SLURM).
#SBATCH --job-name=lipsformer
#SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail

CONFIG=${1:?usage: slurm_train.sh CONFIG RUN_DIR [train.py arguments ...]}
RUN_DIR=${2:?usage: slurm_train.sh CONFIG RUN_DIR [train.py arguments ...]}
shift 2
cd "${SLURM_SUBMIT_DIR:-.}" || exit 1
TRAIN=(train.py --config "$CONFIG" --output "$RUN_DIR" --resume auto --wait-for-lock "${LOCK_WAIT:-900}" "$@")

if [ "${LAUNCH:-srun}" = local ]; then
    command=(python "${TRAIN[@]}")
else
    main_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    gpus=${GPUS_PER_NODE:-8}
    # shellcheck disable=SC2016  # $SLURM_NODEID is expanded by each task's own shell
    command=(srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --multi_gpu --num_machines "$SLURM_NNODES" \
        --machine_rank "$SLURM_NODEID" --num_processes "$((SLURM_NNODES * '"$gpus"'))" \
        --main_process_ip '"$main_host"' --main_process_port 29500 "$@"' bash "${TRAIN[@]}")
fi

time_limit=0
interrupted=0
on_time_limit() {
    echo "slurm_train.sh: the time limit is near; asking train.py to save and stop (SIGTERM)"
    time_limit=1
    interrupted=1
    kill -TERM "$train_pid" 2>/dev/null  # srun passes it to every task, Accelerate to every process
}
trap on_time_limit USR1

"${command[@]}" &
train_pid=$!
while :; do
    wait "$train_pid"
    status=$?
    if [ "$interrupted" = 1 ]; then  # the trap cut this wait short: the training is still saving
        interrupted=0
        continue
    fi
    break
done

if [ "$time_limit" = 1 ]; then
    finished=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["status"] == "finished")' \
               "$RUN_DIR/summary.json" 2>/dev/null)
    if [ "$finished" = True ]; then
        echo "slurm_train.sh: the run finished before the time limit; not requeueing"
    else
        echo "slurm_train.sh: train.py exited with status $status; requeueing job $SLURM_JOB_ID (--resume auto continues)"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
fi
exit "$status"

"""validate.py under ``accelerate launch`` with two CPU processes gives the numbers of a single process.

Accelerate 1.x's ``accelerate launch --cpu --num_processes 2`` starts a single process (its simple launcher);
two gloo processes on a CPU machine come from ``--multi_gpu`` (torch.distributed.run), which validate.py turns
into a multi-CPU run when no GPU is present. 11 images in batches of 4 give each process 2 batches, the last one
padded by Accelerate with repeated samples, which must not be counted twice.
"""
import json
import os
import subprocess
import sys

import safetensors.torch
import timm
import torch
from accelerate.state import AcceleratorState
from imagenet_trees import build_tree, val_file_name, write_jpegs
from process_support import free_port
from validate_reference import file_by_prediction, reference_accuracy, reference_topk

from lipsformer.evaluation.validate_command import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_processes_give_single_process_numbers(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model('test_vit', img_size=32)
    checkpoint = str(tmp_path / 'vit.safetensors')
    safetensors.torch.save_file(model.state_dict(), checkpoint)
    photos = write_jpegs(str(tmp_path / 'photos'), [val_file_name(i) for i in range(1, 12)])
    data_config = dict(input_size=(3, 32, 32), interpolation='bicubic', mean=(0.5,) * 3, std=(0.5,) * 3,
                       crop_pct=0.95, crop_mode='center')
    topk = reference_topk(model.eval(), photos, data_config)
    classes = file_by_prediction(topk)
    expected = reference_accuracy(topk, [[c] for c in classes])
    assert expected == {'count': 11, 'top1': 400 / 11, 'top5': 800 / 11}  # images 0, 3, 6, 9 / all but 2, 5, 8
    val = build_tree(str(tmp_path / 'val'), dict(zip(photos, classes)))
    v2 = build_tree(str(tmp_path / 'v2'), dict(zip(photos, classes)), layout='numeric')
    args = ['--model', 'test_vit', '--checkpoint', checkpoint, '--img-size', '32', '--data-dir', val, '--real-labels',
            '--v2-dir', v2, '--batch-size', '4', '--workers', '0']

    single_file, launched_file = tmp_path / 'single.json', tmp_path / 'launched.json'
    AcceleratorState._reset_state(reset_partial_state=True)
    assert main([*args, '--results-file', str(single_file)]) == 0
    env = dict(os.environ, OMP_NUM_THREADS='1')
    command = [sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2',
               '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no',
               '--main_process_port', str(free_port()), os.path.join(REPO_ROOT, 'validate.py'),
               *args, '--cpu', '--results-file', str(launched_file)]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    single, launched = json.loads(single_file.read_text()), json.loads(launched_file.read_text())

    assert single['settings']['num_processes'] == 1 and launched['settings']['num_processes'] == 2
    assert launched['settings']['device'].startswith('cpu')
    keys = ('dataset', 'name', 'images', 'count', 'top1', 'top5', 'skipped')
    def numbers(record: dict) -> list[dict]:
        return [{k: r[k] for k in keys} for r in record['results']]

    assert numbers(launched) == numbers(single)
    assert [r['images'] for r in launched['results']] == [11, 11, 11]
    for result in (launched['results'][0], launched['results'][2]):  # val and V2, filed identically
        assert {k: result[k] for k in expected} == expected
    assert completed.stdout.count('imagenet-real') == 1  # only the main process prints the table

"""What every pool worker needs imported: loaded once in the fork server that the workers are forked from.

A spawned worker imports torch, autoshard and transformers' model code itself, seconds per process and per pool
(a pool of 8 ranks, restarted after a test that kills a rank, paid it again). The workers fork from one process
that has imported them (``multiprocessing``'s fork server, which runs nothing else: no thread of torch's to copy).
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"  # the workers run one thread each; set before torch loads its OpenMP

import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import transformers  # noqa: E402

import autoshard  # noqa: E402, F401
import autoshard.runtime.parallel_model  # noqa: E402, F401

# transformers resolves its lazy module table on first use (seconds): do it here, with the zoo's model code
for _name in ("LlamaConfig", "LlamaForCausalLM", "GPT2Config", "GPT2LMHeadModel", "BertConfig", "BertForMaskedLM"):
    getattr(transformers, _name)

from harness import golden  # noqa: E402, F401 - the zoo and the golden helpers the tests send to the workers

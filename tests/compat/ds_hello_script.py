"""DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py (a RoBERTa MLM from transformers' classes,
trained from scratch, checkpointed with ``save_checkpoint(client_state={'checkpoint_step': step})`` and
resumed with ``load_checkpoint``), run per rank with ``deepspeed`` given as a parameter (default:
``import deepshard.compat.deepspeed as deepspeed``; bench/record_ds_more_scripts.py passes real DeepSpeed).

Kept as the original: ``collate_function``, ``masking_function`` (numpy's RNG: BOS/EOS never masked,
15% masked, 10% random, 10% unchanged), the map-style dataset, ``InfiniteIterator`` over a shuffled
DataLoader (no DistributedSampler: every rank reads the same batches, as in the original),
``RobertaLMHeadWithMaskedPredict`` (its decoder weight tied to the word embeddings) and
``RobertaMLMModel`` (``lm_head.apply(self._init_weights)``), ``create_model``'s config dict, the
experiment directory with ``hparams.json``, the ds_config (Adam lr 1e-4, ZeRO stage 1 with
``offload_optimizer: cpu``), ``deepspeed.initialize(model, model_parameters=model.parameters(), config)``,
the resume branch (hparams read back, ``load_checkpoint(load_dir=...)``, ``client_state['checkpoint_step']``)
and the loop with its ``save_checkpoint`` calls.

Lines changed, and why:
  - ``import deepspeed`` -> ``deepspeed`` parameter (the one import);
  - wikitext-2 from the hub and roberta-base's tokenizer -> ``TEXTS`` and ``CharTokenizer`` (a character
    vocabulary with RoBERTa's special ids: bos 0, pad 1, eos 2, mask 3): offline;
  - the model: num_layers 6 -> 2, num_heads 8 -> 2, ff_dim 512 -> 32, h_dim 256 -> 16, vocab 50265 -> the
    tokenizer's; ``dropout`` 0.1 -> 0.0 (dropout draws from each process's RNG inside modules the two
    engines wrap differently; the comparison is of the training math); batch_size 8 -> 4,
    max_seq_length 512 -> 24;
  - ``"bf16": {"enabled": True}`` -> False: fp32 on both sides (the comparison asked for is fp32);
  - the experiment name: ``bert_pretrain.<time>.<uuid>`` -> ``bert_pretrain.fixed``: the original names it
    from each rank's clock (ranks may disagree across a second boundary) and the test needs the path;
    its git hash/diff (``sh``), TensorBoard writer and loguru logging are dropped (logging only);
  - ``DataLoader(..., shuffle=True)`` gains ``generator=torch.Generator().manual_seed(0)``: the original
    draws the shuffle's seed from torch's global RNG at the first batch, after ``initialize``, which
    each library may draw from differently;
  - ``fire.Fire(train)`` -> ``main(kwargs, deepspeed)``, which seeds as the original's ``__main__`` does
    (torch 42, numpy 0, random 0) before each ``train`` call: every call is a fresh process there;
    ``train`` returns ``(exp_dir, losses)``.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from functools import partial

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from transformers.models.roberta import RobertaConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaPreTrainedModel

import deepshard.compat.deepspeed as ours

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "deepspeed makes distributed training easy",
    "a tiny model learns to fill in masked letters",
    "zero partitions the optimizer state over ranks",
    "every checkpoint holds the weights and moments",
    "pipelines pass activations from stage to stage",
    "masked language models predict hidden tokens",
    "the loss should fall as the steps go on",
] * 4


class CharTokenizer:
    """roberta-base's special ids, characters for the rest."""

    bos_token_id, pad_token_id, eos_token_id, mask_token_id = 0, 1, 2, 3
    chars = "abcdefghijklmnopqrstuvwxyz "

    @property
    def vocab_size(self) -> int:
        return 4 + len(self.chars)

    @property
    def all_special_ids(self) -> list[int]:
        return [0, 1, 2, 3]

    def encode(self, text, add_special_tokens=False, truncation=True, max_length=None):
        ids = [4 + self.chars.index(c) for c in text]
        return ids[:max_length] if truncation and max_length is not None else ids


def collate_function(batch, pad_token_id):
    max_length = max(len(token_ids) for token_ids, _ in batch)
    padded_token_ids = [token_ids + [pad_token_id for _ in range(0, max_length - len(token_ids))]
                        for token_ids, _ in batch]
    padded_labels = [labels + [pad_token_id for _ in range(0, max_length - len(labels))] for _, labels in batch]
    src_tokens = torch.LongTensor(padded_token_ids)
    tgt_tokens = torch.LongTensor(padded_labels)
    attention_mask = src_tokens.ne(pad_token_id).type_as(src_tokens)
    return {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens, "attention_mask": attention_mask}


def masking_function(text, tokenizer, mask_prob, random_replace_prob, unmask_replace_prob, max_length):
    tokenized_ids = ([tokenizer.bos_token_id]
                     + tokenizer.encode(text, add_special_tokens=False, truncation=True, max_length=max_length - 2)
                     + [tokenizer.eos_token_id])
    seq_len = len(tokenized_ids)
    tokenized_ids = np.array(tokenized_ids)
    subword_mask = np.full(len(tokenized_ids), False)
    low, high = 1, len(subword_mask) - 1
    mask_choices = np.arange(low, high)
    num_subwords_to_mask = max(int((mask_prob * (high - low)) + np.random.rand()), 1)
    subword_mask[np.random.choice(mask_choices, num_subwords_to_mask, replace=False)] = True
    labels = np.full(seq_len, tokenizer.pad_token_id)
    labels[subword_mask] = tokenized_ids[subword_mask]
    tokenized_ids[subword_mask] = tokenizer.mask_token_id
    rand_or_unmask_prob = random_replace_prob + unmask_replace_prob
    if rand_or_unmask_prob > 0:
        rand_or_unmask = subword_mask & (np.random.rand(len(tokenized_ids)) < rand_or_unmask_prob)
        if random_replace_prob == 0:
            unmask, rand_mask = rand_or_unmask, None
        elif unmask_replace_prob == 0:
            unmask, rand_mask = None, rand_or_unmask
        else:
            unmask_prob = unmask_replace_prob / rand_or_unmask_prob
            decision = np.random.rand(len(tokenized_ids)) < unmask_prob
            unmask = rand_or_unmask & decision
            rand_mask = rand_or_unmask & (~decision)
        if unmask is not None:
            tokenized_ids[unmask] = labels[unmask]
        if rand_mask is not None:
            weights = np.ones(tokenizer.vocab_size)
            weights[tokenizer.all_special_ids] = 0
            probs = weights / weights.sum()
            tokenized_ids[rand_mask] = np.random.choice(tokenizer.vocab_size, rand_mask.sum(), p=probs)
    return tokenized_ids.tolist(), labels.tolist()


class TextMLMDataset(Dataset):
    def __init__(self, dataset, masking_function):
        self.dataset = dataset
        self.masking_function = masking_function

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        return self.masking_function(self.dataset[idx]["text"])


class InfiniteIterator:
    def __init__(self, iterable):
        self._iterable = iterable
        self._iterator = iter(self._iterable)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


def create_data_iterator(mask_prob, random_replace_prob, unmask_replace_prob, batch_size, max_seq_length=512):
    dataset = [{"text": t} for t in TEXTS]
    tokenizer = CharTokenizer()
    masking_function_partial = partial(masking_function, tokenizer=tokenizer, mask_prob=mask_prob,
                                       random_replace_prob=random_replace_prob,
                                       unmask_replace_prob=unmask_replace_prob, max_length=max_seq_length)
    dataset = TextMLMDataset(dataset, masking_function_partial)
    collate_fn_partial = partial(collate_function, pad_token_id=tokenizer.pad_token_id)
    dataloader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate_fn_partial,
                            generator=torch.Generator().manual_seed(0))  # changed: see the header
    return InfiniteIterator(dataloader)


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    def __init__(self, config, embedding_weight=None):
        super().__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features, masked_token_indices=None, **kwargs):
        if masked_token_indices is not None:
            features = torch.index_select(features.view(-1, features.shape[-1]), 0, masked_token_indices)
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config, encoder):
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(config, self.encoder.embeddings.word_embeddings.weight)
        self.lm_head.apply(self._init_weights)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        sequence_output, *_ = self.encoder(input_ids=src_tokens, attention_mask=attention_mask, return_dict=False)
        pad_token_id = self.config.pad_token_id
        masked_token_indexes = torch.nonzero((tgt_tokens != pad_token_id).view(-1)).view(-1)
        prediction_scores = self.lm_head(sequence_output, masked_token_indexes)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked_token_indexes)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
        return loss_fct(prediction_scores.view(-1, self.config.vocab_size), target)


def create_model(num_layers, num_heads, ff_dim, h_dim, dropout):
    roberta_config_dict = {
        "attention_probs_dropout_prob": dropout, "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "gelu",
        "hidden_dropout_prob": dropout, "hidden_size": h_dim, "initializer_range": 0.02,
        "intermediate_size": ff_dim, "layer_norm_eps": 1e-05, "max_position_embeddings": 514,
        "model_type": "roberta", "num_attention_heads": num_heads, "num_hidden_layers": num_layers,
        "pad_token_id": 1, "type_vocab_size": 1, "vocab_size": CharTokenizer().vocab_size,  # changed: vocab
    }
    roberta_config = RobertaConfig.from_dict(roberta_config_dict)
    roberta_encoder = RobertaModel(roberta_config)
    return RobertaMLMModel(roberta_config, roberta_encoder)


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def create_experiment_dir(checkpoint_dir, all_arguments):
    exp_dir = checkpoint_dir / "bert_pretrain.fixed"  # changed: see the header
    if not is_rank_0():
        return exp_dir
    exp_dir.mkdir(exist_ok=False)
    with (exp_dir / "hparams.json").open("w") as handle:
        json.dump(obj=all_arguments, fp=handle, indent=2)
    (exp_dir / "tb_dir").mkdir(exist_ok=False)
    return exp_dir


def train(deepspeed, checkpoint_dir=None, load_checkpoint_dir=None, mask_prob=0.15, random_replace_prob=0.1,
          unmask_replace_prob=0.1, max_seq_length=24, num_layers=2, num_heads=2, ff_dim=32, h_dim=16, dropout=0.0,
          batch_size=4, num_iterations=10000, checkpoint_every=1000, log_every=10, local_rank=-1):
    get_accelerator = deepspeed.accelerator.get_accelerator
    device = (torch.device(get_accelerator().device_name(), local_rank)
              if (local_rank > -1) and get_accelerator().is_available() else torch.device("cpu"))
    if checkpoint_dir is None and load_checkpoint_dir is None:
        return None
    if checkpoint_dir is not None and load_checkpoint_dir is not None:
        return None
    if checkpoint_dir:
        checkpoint_dir = pathlib.Path(checkpoint_dir)
        checkpoint_dir.mkdir(exist_ok=True)
        all_arguments = {"mask_prob": mask_prob, "random_replace_prob": random_replace_prob,
                         "unmask_replace_prob": unmask_replace_prob, "max_seq_length": max_seq_length,
                         "num_layers": num_layers, "num_heads": num_heads, "ff_dim": ff_dim, "h_dim": h_dim,
                         "dropout": dropout, "batch_size": batch_size, "num_iterations": num_iterations,
                         "checkpoint_every": checkpoint_every}
        exp_dir = create_experiment_dir(checkpoint_dir, all_arguments)
    else:
        load_checkpoint_dir = pathlib.Path(load_checkpoint_dir)
        assert load_checkpoint_dir.exists()
        with (load_checkpoint_dir / "hparams.json").open("r") as handle:
            hparams = json.load(handle)
        mask_prob = hparams.get("mask_prob", mask_prob)
        random_replace_prob = hparams.get("random_replace_prob", random_replace_prob)
        unmask_replace_prob = hparams.get("unmask_replace_prob", unmask_replace_prob)
        max_seq_length = hparams.get("max_seq_length", max_seq_length)
        ff_dim = hparams.get("ff_dim", ff_dim)
        h_dim = hparams.get("h_dim", h_dim)
        dropout = hparams.get("dropout", dropout)
        num_layers = hparams.get("num_layers", num_layers)
        num_heads = hparams.get("num_heads", num_heads)
        batch_size = hparams.get("batch_size", batch_size)
        num_iterations = max(num_iterations, hparams.get("num_iterations", num_iterations))
        checkpoint_every = hparams.get("checkpoint_every", checkpoint_every)
        exp_dir = load_checkpoint_dir
    data_iterator = create_data_iterator(mask_prob=mask_prob, random_replace_prob=random_replace_prob,
                                         unmask_replace_prob=unmask_replace_prob,
                                         max_seq_length=max_seq_length, batch_size=batch_size)
    model = create_model(num_layers=num_layers, num_heads=num_heads, ff_dim=ff_dim, h_dim=h_dim, dropout=dropout)
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "bf16": {"enabled": False},  # changed: fp32
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    return exp_dir, losses


def main(kwargs: dict, deepspeed=ours):
    """The original's ``__main__``: seeds, then ``train(**kwargs)``."""
    torch.manual_seed(42)
    np.random.seed(0)
    random.seed(0)
    return train(deepspeed, **kwargs)


def hello_run(root: str, deepspeed=ours, load_dir: str | None = None) -> dict:
    """Two invocations, as a user resumes: ``--checkpoint_dir root --num_iterations 7 --checkpoint_every 3``
    (steps 1-6; saves at 3 and 6), then ``--load_checkpoint_dir <exp dir> --num_iterations 11`` (steps 7-10).
    ``load_dir``: resume from there instead (DeepSpeed's own checkpoint, imported)."""
    exp_dir, losses = main({"checkpoint_dir": root, "num_iterations": 7, "checkpoint_every": 3}, deepspeed)
    torch.distributed.barrier()
    _, resumed = main({"load_checkpoint_dir": load_dir or str(exp_dir), "num_iterations": 11}, deepspeed)
    return {"losses": losses, "resumed": resumed, "exp_dir": str(exp_dir)}

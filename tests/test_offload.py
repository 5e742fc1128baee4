"""Activation offload (train.offload_activations, lowmem_grpo/offload.py) on CPU: it moves the checkpointed
layer inputs and nothing inside a layer, a CPU run is unchanged, the forced copy path gives the same gradients,
and the memory model accounts for it. The CUDA side (peak VRAM lower, gradients equal) is tests/gpu/."""

from __future__ import annotations

import weakref

import pytest
import torch

from lowmem_grpo import memory as mm
from lowmem_grpo import tiny
from lowmem_grpo.batch import completion_logprobs, pack
from lowmem_grpo.loss import aggregate
from lowmem_grpo.model import hidden_states
from lowmem_grpo.offload import MAX_IN_FLIGHT, ActivationOffload
from lowmem_grpo.recipe import RecipeError, recipe_from_dict


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def checkpointed_model(tok, layers=3):
    spec = tiny.TinyModelSpec(num_layers=layers)
    model = tiny.build_model(tok, spec, seed=0).double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def test_offload_takes_each_layers_checkpointed_input_and_nothing_inside_a_layer(tok):
    model = checkpointed_model(tok, layers=3)
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)  # a gradient flows through every layer
    b, t, h = 2, 48, model.config.hidden_size
    ids = torch.randint(0, len(tok), (b, t))
    shapes = []

    class Spy(ActivationOffload):
        def _pack(self, x):
            out = super()._pack(x)
            if out is not x:
                shapes.append((tuple(x.shape), x.dtype))
            return out

    with Spy(model, min_bytes=b * t * 8, copy_host_tensors=True) as off:  # >= one [b, t] float64 row set
        hidden_states(model, ids).sum().backward()
    layer_inputs = [s for s in shapes if s == ((b, t, h), torch.float64)]
    assert len(layer_inputs) == 3, shapes            # one per decoder layer: what checkpointing keeps
    # besides them only the final norm's input (float32 inside RMSNorm): nothing from inside a layer
    assert len(shapes) <= 3 + 2, shapes
    assert off.offloaded_bytes == sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in shapes)
    # the parameters (the embedding, the head) are never copied
    assert all(s != tuple(model.model.embed_tokens.weight.shape) for s, _ in shapes)


def test_what_offload_holds_for_its_copies_adds_nothing_to_what_the_decoder_holds(tok):
    """The copy path holds the tensors its copies read (offload.py: held, not record_stream'ed, so that slow
    copies cannot pile up at the peak), at most MAX_IN_FLIGHT = 1: the current layer input, which the decoder
    holds anyway. Counted against the same forward with nothing held: at every pack no more tensors are alive,
    and none after the context exits; the host copies then carry the same backward."""
    model = checkpointed_model(tok, layers=4)
    for n, p in model.named_parameters():
        p.requires_grad_("layers.0." in n and "up_proj" in n)
    b, t = 2, 48
    ids = torch.randint(0, len(tok), (b, t))

    def forward(holds: bool):
        refs, alive = [], []

        class Spy(ActivationOffload):
            def _pack(self, x):
                out = super()._pack(x)
                if out is not x:
                    refs.append(weakref.ref(x))
                    alive.append(sum(r() is not None for r in refs))
                return out

            def _hold_until_copied(self, x, copied):
                if holds:
                    super()._hold_until_copied(x, copied)

        model.zero_grad(set_to_none=True)
        with Spy(model, min_bytes=b * t * 8, copy_host_tensors=True):
            h = hidden_states(model, ids)
        after = sum(r() is not None for r in refs)
        h.sum().backward()
        return alive, after, model.model.layers[0].mlp.up_proj.weight.grad.clone()

    held, held_after, g_held = forward(holds=True)
    free, free_after, g_free = forward(holds=False)
    assert len(held) == len(free) >= 4 + 1                  # the 4 layer inputs and the final norm's input
    assert MAX_IN_FLIGHT == 1 and held == free, (held, free)  # a second one held would show here
    assert held_after == free_after                         # drained on exit: the backward starts with nothing held
    assert torch.equal(g_held, g_free) and g_held.abs().sum() > 0


def _grads(model, tok, offload: bool, copy: bool, monkeypatch):
    """One micro-batch's policy loss backward through the trainer's log-prob path; returns the LoRA-like grads."""
    torch.manual_seed(1)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    completions = [[12, 13, 14, 15, 16], [17, 18, 19]]
    mb = pack(prompts, completions, torch.tensor([1.0, -0.5]), 2, "token_mean", 8, tok.pad_token_id)[0]
    if copy:  # force the host-copy path on CPU tensors, as a GPU run takes it
        monkeypatch.setattr("lowmem_grpo.batch.ActivationOffload",
                            lambda m: ActivationOffload(m, min_bytes=1, copy_host_tensors=True))
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, mb, 1.0, 4, 64, offload=offload)
    aggregate(logp, mb.weights).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("copy", [False, True], ids=["cpu-passthrough", "forced-copy"])
def test_gradients_are_identical_with_offload_on_and_off(tok, copy, monkeypatch):
    model = checkpointed_model(tok, layers=2)
    for n, p in model.named_parameters():
        p.requires_grad_("layers" in n and "proj" in n)
    off = _grads(model, tok, offload=False, copy=False, monkeypatch=monkeypatch)
    on = _grads(model, tok, offload=True, copy=copy, monkeypatch=monkeypatch)
    assert off.keys() == on.keys() and len(off) == 2 * 10  # 7 linears + q/k/v biases per layer
    for n in off:
        assert torch.equal(off[n], on[n]), n  # bit-for-bit: the same values come back


def test_offload_is_off_in_no_grad_passes(tok, monkeypatch):
    made = []
    monkeypatch.setattr("lowmem_grpo.batch.ActivationOffload", lambda m: made.append(m) or ActivationOffload(m))
    model = checkpointed_model(tok, layers=1)
    mb = pack([[5, 6]], [[7, 8, 9]], torch.tensor([1.0]), 1, "token_mean", 4, tok.pad_token_id)[0]
    with torch.no_grad():
        completion_logprobs(model, mb, 1.0, 4, 64, offload=True)
    assert made == []
    completion_logprobs(model, mb, 1.0, 4, 64, offload=True)
    assert len(made) == 1


def test_memory_model_moves_the_layer_inputs_to_host_memory_on_cuda_only():
    shape = mm.ModelShape(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                          head_dim=128, intermediate_size=14336, tie_word_embeddings=False)
    w = mm.Workload(micro_batch_size=1, prompt_tokens=512, completion_tokens=20000, prompts_per_step=1)
    on = mm.Workload(**{**w.__dict__, "offload_activations": True})
    layer = 1 * 20512 * 4096 * 2
    off_est, on_est = mm.estimate(shape, w), mm.estimate(shape, on)
    saved = sum(off_est.phases["train"].values()) - sum(on_est.phases["train"].values())
    assert saved == layer * (32 - 2)  # every layer input but the two in flight
    assert mm.offloaded_host_bytes(shape, on) == layer * (32 + 2)
    assert any("pinned CPU memory" in n for n in on_est.notes)
    cpu = mm.Workload(**{**on.__dict__, "device": "cpu"})
    assert mm.offloaded_host_bytes(shape, cpu) == 0
    assert mm.estimate(shape, cpu).phases["train"] == mm.estimate(shape, mm.Workload(**{**w.__dict__, "device": "cpu"})).phases["train"]


def test_advice_names_offload_for_long_completions_on_cuda():
    shape = mm.ModelShape(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                          head_dim=128, intermediate_size=8960, tie_word_embeddings=True, attention_bias=True)
    w = mm.Workload(micro_batch_size=1, prompt_tokens=256, completion_tokens=64000, prompts_per_step=1,
                    num_generations=2)
    advice = mm.advise(shape, w, mm.estimate(shape, w).peak // 2)
    assert not advice.fits
    assert any("train.offload_activations: true" in line for line in advice.lines), advice.lines


def _recipe(**train):
    return {"model": {"name_or_path": "m"}, "data": {"train_path": "d.jsonl"},
            "rewards": {"functions": [{"function": "exact"}]}, "train": train}


def test_recipe_rejects_offload_without_checkpointing_naming_both_fields():
    d = _recipe(offload_activations=True)
    d["model"]["gradient_checkpointing"] = False
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(d)
    assert "train.offload_activations" in str(err.value) and "model.gradient_checkpointing" in str(err.value)
    assert recipe_from_dict(_recipe(offload_activations=True)).train.offload_activations is True


def test_a_training_run_with_offload_equals_one_without(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """train.offload_activations through the Trainer (4-bit base + LoRA, checkpointing, 3 steps), with the host
    copy forced on CPU tensors as a GPU run takes it: the same losses and adapter weights as without offload."""
    from conftest import QUIET, losses_by_step, recipe_dict

    from lowmem_grpo.train import Trainer

    made = []

    def forced(model):
        made.append(ActivationOffload(model, min_bytes=1, copy_host_tensors=True))
        return made[-1]

    runs = {}
    for offload in (False, True):
        if offload:
            monkeypatch.setattr("lowmem_grpo.batch.ActivationOffload", forced)
        d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / f"run-{offload}", train={"offload_activations": offload})
        trainer = Trainer(recipe_from_dict(d), **QUIET)
        trainer.fit()
        runs[offload] = (losses_by_step(tmp_path / f"run-{offload}"),
                         {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})
    assert made and sum(m.offloaded_tensors for m in made) > 0      # the copy path ran, in the update only
    assert runs[True][0] == runs[False][0] and len(runs[False][0]) == 3
    for name, w in runs[False][1].items():
        assert torch.equal(w, runs[True][1][name]), name


def test_recipe_rejects_offload_with_the_unsloth_backend():
    d = _recipe(offload_activations=True)
    d["model"]["backend"] = "unsloth"
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(d)
    assert "train.offload_activations" in str(err.value) and "model.backend: unsloth" in str(err.value)


def test_offloads_pinned_host_memory_is_checked_against_the_machines_available_ram():
    shape = mm.ModelShape(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                          head_dim=128, intermediate_size=14336, tie_word_embeddings=False)
    w = mm.Workload(micro_batch_size=1, prompt_tokens=512, completion_tokens=20000, prompts_per_step=1,
                    offload_activations=True)
    need = mm.offloaded_host_bytes(shape, w)
    assert need == 20512 * 4096 * 2 * 34                      # 5.3 GiB: 32 layer inputs + the final norm's
    room = need / (1 - mm.HOST_HEADROOM)                       # the least available RAM that holds it
    assert mm.host_memory_problem(shape, w, int(room) + 1) is None
    problem = mm.host_memory_problem(shape, w, int(room) - 1)
    assert problem is not None
    for named in ("train.offload_activations", "train.micro_batch_size", mm.fmt(need), "1 x 20512 tokens"):
        assert named in problem, (named, problem)
    # torchrun's processes on one machine pin theirs side by side
    two = mm.host_memory_problem(shape, w, int(room) + 1, processes=2)
    assert two is not None and f"2 processes x {mm.fmt(need)}" in two
    # nothing is pinned on a CPU, or without offload
    assert mm.host_memory_problem(shape, mm.Workload(**{**w.__dict__, "device": "cpu"}), 0) is None
    assert mm.host_memory_problem(shape, mm.Workload(**{**w.__dict__, "offload_activations": False}), 0) is None


def test_preflight_stops_before_the_forward_when_offload_cannot_pin_its_inputs(tiny_model_dir, tiny_data, tmp_path,
                                                                                monkeypatch):
    """The trainer's wiring, with the CUDA side stubbed: the memory model's workload says cuda (as on a GPU) and
    psutil says the machine has 1 KiB available, less than the tiny micro-batch would pin. Preflight raises
    one TrainingError naming the field, before any forward pass would start pinning (with the RAM to hold it
    the check passes: the test above)."""
    from types import SimpleNamespace

    from conftest import QUIET, recipe_dict

    from lowmem_grpo.train import Trainer, TrainingError

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"offload_activations": True})
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    real = Trainer.memory_model

    def as_on_cuda(self, prompt_tokens):
        shape, workload = real(self, prompt_tokens)
        return shape, mm.Workload(**{**workload.__dict__, "device": "cuda"})

    monkeypatch.setattr(Trainer, "memory_model", as_on_cuda)
    monkeypatch.setattr("lowmem_grpo.train.psutil.virtual_memory", lambda: SimpleNamespace(available=1024))
    need = mm.offloaded_host_bytes(*as_on_cuda(trainer, len(trainer.train_set.longest_prompt())))
    assert need > 1024, need

    class ForwardStarted(Exception):
        pass

    def forward(self, *a, **k):
        raise ForwardStarted

    monkeypatch.setattr(Trainer, "logprobs", forward)
    with pytest.raises(TrainingError) as err:
        trainer.preflight()
    text = str(err.value)
    assert text.startswith("preflight: train.offload_activations") and "of pinned CPU memory" in text, text
    trainer.close()

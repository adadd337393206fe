"""The FP32 main-param wrapper under transformers' Trainer: a bf16 Qwen2 trained by
Trainer(optimizers=(get_hyper_optimizer(..., fp32_main_params=True), scheduler))
against a hand-written FP32 master-weight loop over the same init and the same
batches. Trainer clips with torch.nn.utils.clip_grad_norm_(model.parameters())
and clears the gradients with model.zero_grad(): both see the FP32 gradients
only where they are the params' .grad."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer's own dependency

from hypertrain import optim  # noqa: E402
from hypertrain.lr_scheduler import get_hyper_lr_scheduler  # noqa: E402

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STEPS, BATCH, MAX_NORM = 5, 4, 0.5
MUON = {"lr": 0.02, "momentum": 0.95}
ADAMW = {"lr": 3e-3, "weight_decay": 0.1}


def qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).train()


def split(named):
    muon = [n for n, p in named if any(k in n for k in MATRICES) and p.ndim == 2]
    return muon, [n for n, _ in named if n not in muon]


def optimizer_and_schedule(params, model=None, **kw):
    """Muon + AdamW over params ({name: param}), a cosine schedule."""
    muon, adamw = split(list(params.items()))
    opt = optim.get_hyper_optimizer(model=model, muon_params=[params[n] for n in muon],
                                    adamw_params=[params[n] for n in adamw], muon_kwargs=MUON, adamw_kwargs=ADAMW,
                                    **kw)
    return opt, get_hyper_lr_scheduler(opt, scheduler_type="cosine", total_steps=STEPS, warmup_steps=0)


class RecordingTrainer(transformers.Trainer):
    """Trainer's loop as it is; its loss is the model's mean cross entropy (the hand-written loop's), and each
    batch and loss is kept to replay."""

    seen = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"], labels=inputs["labels"])
        self.seen.append((inputs["input_ids"].clone(), inputs["labels"].clone(), out.loss.detach().item()))
        return (out.loss, out) if return_outputs else out.loss


def fp32_master_loop(batches):
    """The reference: bf16 forward and backward, the bf16 gradients as FP32 master grads, torch's clip over them,
    the same optimizers and schedule on the FP32 masters, the masters rounded back into the bf16 model."""
    model = qwen2()
    names = [n for n, _ in model.named_parameters()]
    masters = {n: torch.nn.Parameter(p.detach().float()) for n, p in model.named_parameters()}
    opt, sched = optimizer_and_schedule(masters)
    losses, norms = [], []
    for x, labels in batches:
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        for n, p in model.named_parameters():
            masters[n].grad = p.grad.float()
            p.grad = None
        norms.append(torch.nn.utils.clip_grad_norm_([masters[n] for n in names], MAX_NORM).item())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        sched.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])
    return model, masters, losses, norms


def test_trainer_with_the_fp32_wrapper_is_the_fp32_master_loop(tmp_path):
    """Bitwise, step by step: the logged losses and grad norms, then the main params and the bf16 model. Each
    side runs the same operations on the same values in the same order (the bf16 gradient cast to FP32 by
    autograd, grad_dtype, on one side and by .float() on the other; torch's clip_grad_norm_ over the same FP32
    tensors in the same order; the same kernels on the same masters), so no tolerance is needed."""
    gen = torch.Generator().manual_seed(5)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, 96, (3 * BATCH, 12), generator=gen)]
    model = qwen2()
    opt, sched = optimizer_and_schedule(dict(model.named_parameters()), model=model, fp32_main_params=True)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                                          max_steps=STEPS, logging_steps=1, max_grad_norm=MAX_NORM,
                                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                                          seed=0, dataloader_num_workers=0)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    trainer.seen = []
    trainer.train()
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [h["step"] for h in logged] == list(range(1, STEPS + 1)) and len(trainer.seen) == STEPS

    ref, masters, losses, norms = fp32_master_loop([(x, labels) for x, labels, _ in trainer.seen])
    assert all(n > MAX_NORM for n in norms), f"the grad norms {norms} do not all clip: the case tests less"
    for step, (h, (_, _, loss)) in enumerate(zip(logged, trainer.seen)):
        assert h["loss"] == loss == losses[step], f"step {step + 1}: loss {h['loss']}, the FP32 loop's {losses[step]}"
        assert h["grad_norm"] == norms[step], \
            f"step {step + 1}: Trainer's grad norm {h['grad_norm']}, the FP32 loop's {norms[step]}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.main_param, masters[name]), f"{name}: the main param parts from the FP32 master"
        assert torch.equal(p, q), f"{name}: the bf16 param parts from the FP32 loop's"

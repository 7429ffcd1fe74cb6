"""Real-world 18 on a library model: a tiny `LlamaForCausalLM` built from a `LlamaConfig` and
fine-tuned under float16 autocast. Its layer-0 MLP carries the "massive activation" of a model
pre-trained in bfloat16 (Sun et al. 2024; transformers issues about Llama/Mistral fp16 NaN): the
first token of a document (<s>) drives `down_proj` past 65504, and the final RMSNorm computes
inf * rsqrt(inf) = inf * 0 = NaN. No weights are downloaded."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

BOS = 1
VOCAB = 64


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=32, bos_token_id=BOS, eos_token_id=2)
    model = LlamaForCausalLM(config)
    # What pre-training left in the checkpoint: eight MLP units that fire ~100x on <s>, all
    # written into hidden channel 0 by down_proj.
    mlp, embed = model.model.layers[0].mlp, model.model.embed_tokens.weight
    with torch.no_grad():
        direction = embed[BOS] / embed[BOS].norm()
        mlp.gate_proj.weight[:8] = 20.0 * direction
        mlp.up_proj.weight[:8] = 20.0 * direction
        mlp.down_proj.weight[0, :8] = 1.0
    return model


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        ids = torch.randint(3, VOCAB, (4, 8), generator=g)    # mid-document windows
        if step == 1:
            ids[2, 0] = BOS                                     # one window starts a document
        yield {"input_ids": ids, "labels": ids.clone()}


def loss(model, batch):
    return model(**batch).loss

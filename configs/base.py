"""The paper's base setup on WMT14 English-German (Vaswani et al. 2017, section 5).

    jattn train --config configs/base.py --workdir runs/base
    jattn train --config configs/base.py:shaw --workdir runs/base_shaw
    jattn train --config configs/base.py:rope,chunked --workdir runs/base_rope

- model: 6+6 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.1, shared
  embeddings scaled by sqrt(d_model), post-layer-norm, sinusoidal positions;
- Adam (beta1 0.9, beta2 0.98, eps 1e-9), lr = d_model^-0.5 *
  min(step^-0.5, step * 4000^-1.5); label smoothing 0.1;
- batches of about 25k source and 25k target tokens: 96 packed rows of 256
  tokens (~24.6k of each when packing is dense), 100k steps (the base
  model's 12 hours on 8 P100s);
- shared SentencePiece vocabulary of 37k (the paper used BPE, 37k);
- beam search, beam 4, length penalty alpha 0.6.

The data set is tfds `wmt14_translate/de-en` (downloaded and prepared by
tfds into `data_dir` on first use). `:arg` takes the variants of
`jattn.train.apply_variant`: a positional scheme, an attention
implementation, `bf16`, `greedy`/`beam`, comma-separated.
"""

from jattn.train.config import apply_variant, default_config


def get_config(arg=None):
    c = default_config()
    c.dataset = "wmt14_translate/de-en"
    c.source_key = "en"
    c.target_key = "de"
    c.tokenizer = "spm"
    c.vocab_size = 37_000
    c.vocab_multiple = 128
    c.max_len = 256
    c.pack = True
    c.overlong = "drop"

    c.batch_size = 96
    c.num_train_steps = 100_000
    c.optimizer = "adam"
    c.schedule = "rsqrt"
    c.learning_rate = 1.0
    c.warmup_steps = 4000
    c.adam_b1, c.adam_b2, c.adam_eps = 0.9, 0.98, 1e-9
    c.label_smoothing = 0.1
    c.mesh_shape = (-1, 1, 1)

    c.eval_every_steps = 5000
    c.eval_splits = ("validation", "test")
    c.eval_batch_size = 64
    c.eval_max_len = 256
    c.eval_max_batches = 16
    c.eval_decode_examples = 512
    c.decode = "beam"
    c.beam_size = 4
    c.beam_alpha = 0.6
    c.decode_max_len = 256
    c.best_metric = "eval/validation/bleu"

    c.checkpoint_every_steps = 2000
    c.keep_checkpoints = 3
    c.log_every_steps = 100

    c.model.d_model = 512
    c.model.num_heads = 8
    c.model.num_layers = 6
    c.model.d_ff = 2048
    c.model.dropout_rate = 0.1
    c.model.max_len = 256
    c.model.position = "sinusoidal"
    c.model.share_embeddings = True
    c.model.scale_embeddings = True
    c.model.pre_norm = False
    return apply_variant(c, arg)

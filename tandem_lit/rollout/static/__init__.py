"""FastEngine and its static-cache decoders.

- ``engine``: FastEngine, the buffers both models share, CUDA-graph capture and replay;
- ``continuous``: one ``generate`` as a queue (admission, prefill, retirement, compaction,
  preemption, timing); ``scheduler`` and ``paging``: its host-side slot and page bookkeeping;
- ``plain``: the Llama-family decoder (Llama, Mistral, Qwen2, Qwen3);
- ``hybrid``: Qwen3.5's decoder (Gated DeltaNet states beside gated full attention);
- ``blocks``: what both decoders use (linear layers over live weights, fused projections, norms,
  rotary, the prefill through a model's own stack);
- ``kernels``: the Triton kernels of the CUDA decode step (imported only on CUDA).
"""

from tandem_lit.rollout.static.engine import FastEngine, check_architecture, decoder_model

__all__ = ["FastEngine", "check_architecture", "decoder_model"]

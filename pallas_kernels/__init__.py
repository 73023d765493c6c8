"""Pallas attention kernels for jaxinfer (GPU Triton + TPU Mosaic), each with a jnp reference."""

from pallas_kernels.flash_attention import flash_attention, flash_attention_reference

__all__ = ["flash_attention", "flash_attention_reference"]

//! The simulated d-Matrix Corsair card.
//!
//! Owns the hardware profile, the compiler (placement, tiling, memory plan) for a card's share of
//! the experts, dense FFN slices and LM-head rows, the sanitizer that proves each program, the
//! executor with real numerics, the performance model, and the card service.
//!
//! Must not: depend on `gpu-attention`; it knows the attention node only through `proto`.

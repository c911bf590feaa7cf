// CPU flash attention: tiled online softmax forward, two-pass backward (dK/dV, then dQ).
#pragma once

#include "../attn_params.h"

namespace ringseq {

// Forward: writes out (dtype) and lse (accumulation type). Requires batch, seqlen_q,
// seqlen_k, nheads > 0 (the binding handles empty inputs).
void flash_fwd_cpu(const FwdParams& params);

// Backward with a caller-provided delta; overwrites or accumulates dq/dk/dv (see BwdParams).
void flash_bwd_cpu(const BwdParams& params);

}  // namespace ringseq

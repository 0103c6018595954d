package checkpoint

import (
	"encoding/json"
	"fmt"
)

// ClaimRecord is one claim's record as the checkpoint holds it, with the
// original values of the GPU settings the claim changed, in a form kept
// beside the claim (in its CDI spec) so that a lost or corrupted checkpoint
// can be rebuilt whole. It follows the file's rules: it carries the format
// version, a binary reads every version up to its own, and fields a newer
// binary added are ignored by an older one.
type ClaimRecord struct {
	Claim Claim `json:"claim"`
	// GPUs holds, by GPU UUID, the originals of the settings the claim
	// needs: what to restore once no claim needs them.
	GPUs map[string]GPUOriginal `json:"gpus,omitempty"`
}

type recordEnvelope struct {
	Version int `json:"version"`
	ClaimRecord
}

// EncodeClaimRecord renders r in the current format.
func EncodeClaimRecord(r ClaimRecord) (string, error) {
	raw, err := json.Marshal(recordEnvelope{Version: Version, ClaimRecord: r})
	if err != nil {
		return "", fmt.Errorf("encode claim record: %w", err)
	}
	return string(raw), nil
}

// DecodeClaimRecord reads a record of any supported version. Errors wrap
// ErrCorrupt, except for a version newer than this binary's.
func DecodeClaimRecord(s string) (ClaimRecord, error) {
	var env recordEnvelope
	if err := json.Unmarshal([]byte(s), &env); err != nil {
		return ClaimRecord{}, fmt.Errorf("%w: claim record: %v", ErrCorrupt, err)
	}
	if env.Version < 1 {
		return ClaimRecord{}, fmt.Errorf("%w: claim record: missing or invalid version %d", ErrCorrupt, env.Version)
	}
	if env.Version > Version {
		return ClaimRecord{}, fmt.Errorf("claim record format version %d is newer than this plugin's %d", env.Version, Version)
	}
	switch env.Claim.Phase {
	case PrepareStarted, PrepareCompleted, UnprepareStarted:
	default:
		return ClaimRecord{}, fmt.Errorf("%w: claim record has unknown phase %q", ErrCorrupt, env.Claim.Phase)
	}
	return env.ClaimRecord, nil
}

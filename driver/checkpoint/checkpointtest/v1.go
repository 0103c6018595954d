// Package checkpointtest writes checkpoints as Tessera's first release did,
// so that upgrade tests can start the current plugin over a node an older
// plugin left behind.
package checkpointtest

import (
	"encoding/json"
	"fmt"
	"hash/crc32"

	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// The types below are the checkpoint payload of the first release (commit
// ed95c15, format version 1), frozen: names, tags, field order and omitempty
// as that release had them, without the fields added since (MPS, MIG, shares,
// GPU settings and originals). Stripping keys from the current encoder's
// output would also drop them, but re-encoding through these types writes
// byte for byte what that release wrote, checksum included, which
// TestEncodeV1WritesThePinnedFile [driver/checkpoint] checks against
// testdata/v1.json. The current types cannot stand in: their omitempty fields
// happen to vanish for a plain claim, but nothing would notice if one stopped
// doing so.
type (
	v1Data struct {
		BootID string             `json:"bootID"`
		Claims map[string]v1Claim `json:"claims"`
	}
	v1Claim struct {
		Namespace string     `json:"namespace"`
		Name      string     `json:"name"`
		Phase     string     `json:"phase"`
		Devices   []v1Device `json:"devices"`
	}
	v1Device struct {
		Requests     []string `json:"requests,omitempty"`
		Pool         string   `json:"pool"`
		Device       string   `json:"device"`
		AdminAccess  bool     `json:"adminAccess,omitempty"`
		CDIDeviceIDs []string `json:"cdiDeviceIDs,omitempty"`
	}
	v1Envelope struct {
		Version  int             `json:"version"`
		Checksum uint32          `json:"checksum"`
		Data     json.RawMessage `json:"data"`
	}
)

// EncodeV1 renders d as the first release wrote it. Data that release could
// not have held (a MIG partition, a share, GPU settings, an MPS daemon) is an
// error: no node can have such a file.
func EncodeV1(d checkpoint.Data) ([]byte, error) {
	if len(d.GPUs) > 0 {
		return nil, fmt.Errorf("GPU originals %v: the first release changed no GPU setting", d.GPUs)
	}
	old := v1Data{BootID: d.BootID, Claims: map[string]v1Claim{}}
	for uid, c := range d.Claims {
		if c.MPS != nil {
			return nil, fmt.Errorf("claim %s: MPS daemon: the first release had no MPS", uid)
		}
		oc := v1Claim{Namespace: c.Namespace, Name: c.Name, Phase: string(c.Phase)}
		for _, dev := range c.Devices {
			if dev.MIG != nil || dev.ShareID != "" || dev.MemoryBytes != 0 || dev.GPU != "" || dev.Settings != nil {
				return nil, fmt.Errorf("claim %s: device %s uses MIG, sharing or GPU settings, which the first release did not have", uid, dev.Device)
			}
			oc.Devices = append(oc.Devices, v1Device{
				Requests: dev.Requests, Pool: dev.Pool, Device: dev.Device,
				AdminAccess: dev.AdminAccess, CDIDeviceIDs: dev.CDIDeviceIDs,
			})
		}
		old.Claims[uid] = oc
	}
	payload, err := json.Marshal(old)
	if err != nil {
		return nil, err
	}
	return json.MarshalIndent(v1Envelope{Version: 1, Checksum: crc32.ChecksumIEEE(payload), Data: payload}, "", " ")
}

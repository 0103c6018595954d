// Package checkpoint persists which claims a node has prepared, so that a
// restarted plugin knows what it owns.
//
// The contract:
//   - The file holds every claim the plugin has started or finished preparing
//     or unpreparing, with the devices each holds. It is replaced atomically
//     (temp file, fsync, rename): a crash of the plugin leaves the old or the
//     new file, never a mix. Unlike WriteFileAtomic, the rename is not
//     fsynced: only a crash of the machine could lose it, the machine then
//     reboots, and the state of an earlier boot is discarded (boot ID below)
//     whichever of the two complete files survived. That halves the cost of
//     each write, which every prepare and unprepare waits for.
//   - It carries a format version. A binary reads every version up to its own
//     and migrates older ones forward; fields a newer binary added are ignored
//     by an older one (downgrades keep working within a version).
//   - Its checksum covers the stored payload bytes (in compact JSON form), not
//     a re-encoding of decoded structs, so adding a field never makes an old
//     file look corrupted (the anchor driver's upgrade failure).
//   - It carries the boot ID it was written under. Prepared state does not
//     survive a reboot (CDI specs live on tmpfs, MIG instances vanish), so a
//     different boot ID means the state is stale.
//   - A file that cannot be read is reported as ErrCorrupt; the caller rebuilds
//     state from what is on disk rather than crash-looping. For that, each
//     claim's record can also be kept beside the claim (ClaimRecord, written
//     into its CDI spec), under the same rules of versions and added fields.
package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Version is the format this binary writes.
const Version = 1

// FileName is the checkpoint's name inside the plugin data directory.
const FileName = "checkpoint.json"

// ErrCorrupt marks a checkpoint that exists but cannot be trusted.
var ErrCorrupt = errors.New("checkpoint is corrupted")

// Phase is where a claim stands in its two-phase prepare or unprepare.
type Phase string

const (
	PrepareStarted   Phase = "PrepareStarted"
	PrepareCompleted Phase = "PrepareCompleted"
	UnprepareStarted Phase = "UnprepareStarted"
)

// Claim is one claim's prepared state.
type Claim struct {
	Namespace string   `json:"namespace"`
	Name      string   `json:"name"`
	Phase     Phase    `json:"phase"`
	Devices   []Device `json:"devices"`
	// MPS is the claim's MPS control daemon, recorded with the
	// PrepareStarted mark before it is started.
	MPS *MPSDaemon `json:"mps,omitempty"`
	// IMEX is a gang domain claim's IMEX daemon on this node
	// (driver/imex), recorded with the PrepareStarted mark before it is
	// started.
	IMEX *Daemon `json:"imex,omitempty"`
	// Domain marks a gang domain claim (driver/domain): recorded, without
	// devices, only so that a restart tells its CDI spec from an orphan.
	Domain bool `json:"domain,omitempty"`
}

// Daemon locates a claim's daemon pod (an MPS control daemon, an IMEX
// daemon).
type Daemon struct {
	// Pod is the daemon's pod, in the plugin's namespace.
	Pod string `json:"pod"`
	// Dir holds the daemon's files on the host: an MPS daemon's pipe, log
	// and shared-memory directories, an IMEX daemon's configuration.
	Dir string `json:"dir"`
}

// MPSDaemon locates a claim's MPS control daemon.
type MPSDaemon = Daemon

// Device is one allocated device as prepared for a claim.
type Device struct {
	Requests     []string `json:"requests,omitempty"`
	Pool         string   `json:"pool"`
	Device       string   `json:"device"`
	AdminAccess  bool     `json:"adminAccess,omitempty"`
	CDIDeviceIDs []string `json:"cdiDeviceIDs,omitempty"`
	// MIG is the partition Tessera creates for the device. It is recorded
	// with the PrepareStarted mark, before the partition exists, so that a
	// crash at any point can be rolled back from the checkpoint alone.
	MIG *MIGPartition `json:"mig,omitempty"`
	// ShareID is set when the device is one share of a device several
	// claims hold at once (time slices, memory shares).
	ShareID string `json:"shareID,omitempty"`
	// MemoryBytes is the memory a shared device's claim was granted.
	MemoryBytes int64 `json:"memoryBytes,omitempty"`
	// GPU is the UUID of the GPU the settings below apply to.
	GPU string `json:"gpu,omitempty"`
	// Settings are what the claim's configuration asks of the GPU.
	Settings *Settings `json:"settings,omitempty"`
}

// Settings are GPU settings a claim needs while it holds the GPU.
type Settings struct {
	// ComputeMode is "Default" (time-slicing) or "ExclusiveProcess" (MPS).
	ComputeMode string `json:"computeMode,omitempty"`
	// PowerLimitMW caps the board's power, in milliwatts.
	PowerLimitMW uint32 `json:"powerLimitMW,omitempty"`
}

// GPUOriginal is what a GPU's settings were before Tessera changed them,
// recorded before the change and restored when no claim needs it any more.
type GPUOriginal struct {
	ComputeMode  *string `json:"computeMode,omitempty"`
	PowerLimitMW *uint32 `json:"powerLimitMW,omitempty"`
}

// MIGPartition locates a MIG partition on its GPU.
type MIGPartition struct {
	GPUUUID string `json:"gpuUUID"`
	// ProfileIndex is the profile's GPU_INSTANCE_PROFILE_* index (the
	// identity mig.Profile.Index gives a profile), stored under the name
	// every version wrote it with; it was the index then too.
	ProfileIndex int  `json:"profileID"`
	Start        int  `json:"start"`
	Size         int  `json:"size"`
	Switchable   bool `json:"switchable,omitempty"`
	// Set once the partition exists:
	GPUInstance     int    `json:"gpuInstance,omitempty"`
	ComputeInstance int    `json:"computeInstance,omitempty"`
	UUID            string `json:"uuid,omitempty"`
}

// Data is the checkpoint's content.
type Data struct {
	BootID string `json:"bootID"`
	// Claims by claim UID.
	Claims map[string]Claim `json:"claims"`
	// GPUs holds, by GPU UUID, the settings Tessera changed and must
	// restore.
	GPUs map[string]GPUOriginal `json:"gpus,omitempty"`
	// DomainClaims says the file records every gang domain claim of its
	// boot. A file without it was written by a version that did not (or,
	// in a rolling update, rewritten by one): the domain specs found with
	// it are adopted as prepared, never removed as orphans.
	DomainClaims bool `json:"domainClaims,omitempty"`
}

// envelope is the on-disk form: the payload is kept as raw bytes so the
// checksum is verified over exactly what was written.
type envelope struct {
	Version  int             `json:"version"`
	Checksum uint32          `json:"checksum"`
	Data     json.RawMessage `json:"data"`
}

// Encode renders data in the current format.
func Encode(d Data) ([]byte, error) {
	if d.Claims == nil {
		d.Claims = map[string]Claim{}
	}
	payload, err := json.Marshal(d)
	if err != nil {
		return nil, fmt.Errorf("encode checkpoint: %w", err)
	}
	return json.MarshalIndent(envelope{Version: Version, Checksum: crc32.ChecksumIEEE(payload), Data: payload}, "", " ")
}

// Decode reads any supported version. Errors wrap ErrCorrupt and say what is
// wrong; a version newer than this binary's is refused with the fix.
func Decode(raw []byte) (Data, error) {
	var env envelope
	if err := json.Unmarshal(raw, &env); err != nil {
		return Data{}, fmt.Errorf("%w: not a checkpoint envelope: %v", ErrCorrupt, err)
	}
	if env.Version < 1 {
		return Data{}, fmt.Errorf("%w: missing or invalid version %d", ErrCorrupt, env.Version)
	}
	if env.Version > Version {
		return Data{}, fmt.Errorf("checkpoint format version %d is newer than this plugin's %d: roll forward to the newer plugin, or remove the checkpoint after unpreparing its claims", env.Version, Version)
	}
	// Compact first: the indented envelope may have re-spaced the payload.
	if sum := crc32.ChecksumIEEE(compact(env.Data)); sum != env.Checksum {
		return Data{}, fmt.Errorf("%w: checksum %08x does not match content %08x", ErrCorrupt, env.Checksum, sum)
	}
	var d Data
	if err := json.Unmarshal(env.Data, &d); err != nil {
		return Data{}, fmt.Errorf("%w: payload: %v", ErrCorrupt, err)
	}
	if d.Claims == nil {
		d.Claims = map[string]Claim{}
	}
	for uid, c := range d.Claims {
		switch c.Phase {
		case PrepareStarted, PrepareCompleted, UnprepareStarted:
		default:
			return Data{}, fmt.Errorf("%w: claim %s has unknown phase %q", ErrCorrupt, uid, c.Phase)
		}
	}
	return d, nil
}

func compact(b []byte) []byte {
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return b
	}
	return buf.Bytes()
}

// Store reads and writes the checkpoint file in one directory. It does no
// locking of its own: its one caller serialises writes.
type Store struct {
	path string
	// OnWrite, if set (before the Store is used), is told how long each
	// successful Write took, fsync included: the plugin's metric of what a
	// node's disk costs every prepare and unprepare.
	OnWrite func(took time.Duration)
}

// NewStore uses dir (created 0750 when missing) for the checkpoint.
func NewStore(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create checkpoint directory: %w", err)
	}
	return &Store{path: filepath.Join(dir, FileName)}, nil
}

// Path is the checkpoint file's path.
func (s *Store) Path() string { return s.path }

// Load reads the checkpoint; a missing file is an empty one.
func (s *Store) Load() (Data, error) {
	raw, err := os.ReadFile(s.path)
	if errors.Is(err, os.ErrNotExist) {
		return Data{Claims: map[string]Claim{}}, nil
	}
	if err != nil {
		return Data{}, fmt.Errorf("read checkpoint %s: %w", s.path, err)
	}
	d, err := Decode(raw)
	if err != nil {
		return Data{}, fmt.Errorf("checkpoint %s: %w", s.path, err)
	}
	return d, nil
}

// Save replaces the checkpoint atomically and durably.
func (s *Store) Save(d Data) error {
	raw, err := Encode(d)
	if err != nil {
		return err
	}
	return s.Write(raw)
}

// Write replaces the checkpoint with already encoded content (Encode),
// atomically and durably (see the package comment for why the rename is not
// fsynced).
func (s *Store) Write(raw []byte) error {
	began := time.Now()
	tmp, err := stageFile(s.path, raw, 0o600)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, s.path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("replace %s: %w", s.path, err)
	}
	if s.OnWrite != nil {
		s.OnWrite(time.Since(began))
	}
	return nil
}

// Quarantine copies an unreadable checkpoint aside (for a post-mortem) and
// returns where. The file itself stays until the caller replaces it with a
// rebuilt one (Save): moved away, a crash before that would leave no
// checkpoint at all, which reads as a node with nothing prepared.
func (s *Store) Quarantine(suffix string) (string, error) {
	dst := s.path + ".corrupt-" + suffix
	raw, err := os.ReadFile(s.path)
	if err == nil {
		err = os.WriteFile(dst, raw, 0o600)
	}
	if err != nil {
		return "", fmt.Errorf("copy corrupted checkpoint aside: %w", err)
	}
	return dst, nil
}

// WriteFileAtomic writes data to path through a temp file in the same
// directory, fsyncs it, renames it over path and fsyncs the directory, for
// files that must survive a reboot as written.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := stageFile(path, data, perm)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("replace %s: %w", path, err)
	}
	dir := filepath.Dir(path)
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	defer func() { _ = d.Close() }()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// stageFile writes data with perm to a new temp file beside path, fsyncs it
// and returns its name; on error nothing is left behind.
func stageFile(path string, data []byte, perm os.FileMode) (_ string, err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	if _, err := f.Write(data); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Chmod(perm); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return "", fmt.Errorf("sync %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	return f.Name(), nil
}

// BootID reads the kernel's boot ID from path (normally
// /proc/sys/kernel/random/boot_id).
func BootID(path string) (string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read boot ID: %w", err)
	}
	return strings.TrimSpace(string(raw)), nil
}

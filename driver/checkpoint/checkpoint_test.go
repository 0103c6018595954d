package checkpoint

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func sample() Data {
	return Data{BootID: "boot-1", Claims: map[string]Claim{
		"uid-1": {Namespace: "default", Name: "train-0", Phase: PrepareCompleted, Devices: []Device{
			{Requests: []string{"gpus"}, Pool: "node-a", Device: "gpu-3", CDIDeviceIDs: []string{"gpu.tessera.dev/gpu=uid-1-gpu-3"}},
		}},
		"uid-2": {Namespace: "ml", Name: "infer", Phase: PrepareStarted, Devices: []Device{{Pool: "node-a", Device: "gpu-4", AdminAccess: true}}},
	}}
}

func TestRoundTrip(t *testing.T) {
	s, err := NewStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	empty, err := s.Load()
	if err != nil || len(empty.Claims) != 0 {
		t.Fatalf("missing file: %v %v", empty, err)
	}
	if err := s.Save(sample()); err != nil {
		t.Fatal(err)
	}
	got, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(sample(), got); diff != "" {
		t.Errorf("round trip (-want +got):\n%s", diff)
	}
	fi, err := os.Stat(s.Path())
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("checkpoint mode %v is readable by others", fi.Mode().Perm())
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(s.Path()), ".*tmp*"))
	if len(left) != 0 {
		t.Errorf("temp files left behind: %v", left)
	}
}

// TestReadsVersion1Files keeps every checkpoint this format ever wrote
// readable: testdata/v1.json was written by version 1 and must never change.
func TestReadsVersion1Files(t *testing.T) {
	raw, err := os.ReadFile("testdata/v1.json")
	if err != nil {
		t.Fatal(err)
	}
	got, err := Decode(raw)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(sample(), got); diff != "" {
		t.Errorf("v1 file (-want +got):\n%s", diff)
	}
}

// TestToleratesFieldsFromANewerMinorVersion: a field added later (same format
// version) must neither break the checksum nor the decoding.
func TestToleratesFieldsFromANewerMinorVersion(t *testing.T) {
	raw := []byte(`{"version":1,"checksum":0,"data":{"bootID":"b","claims":{"u":{"namespace":"n","name":"c","phase":"PrepareCompleted","devices":[{"pool":"p","device":"gpu-0","futureField":{"x":1}}],"anotherNewField":true}}}}`)
	env := envelope{}
	if err := jsonUnmarshal(raw, &env); err != nil {
		t.Fatal(err)
	}
	raw = []byte(strings.Replace(string(raw), `"checksum":0`, `"checksum":`+itoa(checksum(env.Data)), 1))
	d, err := Decode(raw)
	if err != nil {
		t.Fatal(err)
	}
	if d.Claims["u"].Devices[0].Device != "gpu-0" {
		t.Errorf("decoded %+v", d)
	}
}

func TestCorruptionIsReportedNotPanicked(t *testing.T) {
	good, err := Encode(sample())
	if err != nil {
		t.Fatal(err)
	}
	for name, raw := range map[string][]byte{
		"empty":         {},
		"truncated":     good[:len(good)/2],
		"garbage":       []byte("\x00\x01not json"),
		"flipped byte":  []byte(strings.Replace(string(good), "gpu-3", "gpu-8", 1)),
		"no version":    []byte(`{"data":{}}`),
		"unknown phase": mustEnvelope(t, `{"bootID":"b","claims":{"u":{"phase":"Exploded"}}}`),
		"payload wrong": mustEnvelope(t, `{"bootID":7}`),
	} {
		_, err := Decode(raw)
		if !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: got %v, want ErrCorrupt", name, err)
		}
	}
}

func TestNewerFormatIsRefusedWithTheFix(t *testing.T) {
	_, err := Decode([]byte(`{"version":99,"checksum":0,"data":{}}`))
	if err == nil || errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "newer") {
		t.Fatalf("got %v, want a 'newer version' error that is not corruption", err)
	}
}

func TestQuarantineCopiesTheFileAsideAndLeavesItUntilReplaced(t *testing.T) {
	s, _ := NewStore(t.TempDir())
	if err := os.WriteFile(s.Path(), []byte("junk"), 0o600); err != nil {
		t.Fatal(err)
	}
	dst, err := s.Quarantine("123")
	if err != nil {
		t.Fatal(err)
	}
	if data, _ := os.ReadFile(dst); string(data) != "junk" {
		t.Errorf("quarantined content %q", data)
	}
	if data, _ := os.ReadFile(s.Path()); string(data) != "junk" {
		t.Errorf("checkpoint after quarantine %q, want it left until replaced", data)
	}
}

func TestOnWriteIsToldOfEachSuccessfulWrite(t *testing.T) {
	dir := t.TempDir()
	s, err := NewStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	var took []time.Duration
	s.OnWrite = func(d time.Duration) { took = append(took, d) }
	for range 2 {
		if err := s.Save(sample()); err != nil {
			t.Fatal(err)
		}
	}
	if len(took) != 2 || took[0] <= 0 || took[1] <= 0 {
		t.Fatalf("OnWrite saw %v, want two positive durations", took)
	}
	// A write that fails (the directory is gone) is not reported.
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := s.Save(sample()); err == nil {
		t.Fatal("Save into a removed directory succeeded")
	}
	if len(took) != 2 {
		t.Errorf("OnWrite told of a failed write: %v", took)
	}
}

package checkpoint

import (
	"encoding/json"
	"hash/crc32"
	"strconv"
	"testing"
)

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }
func checksum(b []byte) uint32            { return crc32.ChecksumIEEE(compact(b)) }
func itoa(u uint32) string                { return strconv.FormatUint(uint64(u), 10) }

func mustEnvelope(t *testing.T, payload string) []byte {
	t.Helper()
	raw, err := json.Marshal(envelope{Version: Version, Checksum: checksum([]byte(payload)), Data: json.RawMessage(payload)})
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

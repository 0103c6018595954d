package checkpoint

import (
	"os"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// FuzzDecode: any bytes either decode or fail with a described error; what
// decodes survives a re-encode unchanged.
func FuzzDecode(f *testing.F) {
	if raw, err := os.ReadFile("testdata/v1.json"); err == nil {
		f.Add(raw)
	}
	f.Add([]byte(`{"version":1,"checksum":0,"data":{}}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		d, err := Decode(raw)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			return
		}
		again, err := Encode(d)
		if err != nil {
			t.Fatal(err)
		}
		d2, err := Decode(again)
		if err != nil {
			t.Fatalf("re-encoded checkpoint does not decode: %v", err)
		}
		if diff := cmp.Diff(d, d2); diff != "" {
			t.Fatalf("round trip changed data:\n%s", diff)
		}
	})
}

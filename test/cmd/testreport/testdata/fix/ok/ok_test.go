package ok

import (
	"testing"
	"time"
)

func TestQuick(t *testing.T) { t.Log("quick one") }

func TestSlow(t *testing.T) {
	for _, name := range []string{"first", "second"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			time.Sleep(200 * time.Millisecond)
		})
	}
}

func TestSkipped(t *testing.T) { t.Skip("not here") }

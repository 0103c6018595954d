package hangs

import (
	"testing"
	"time"
)

func TestDone(t *testing.T) {}

func TestWaits(t *testing.T) {
	t.Run("ForeverOnATimer", func(t *testing.T) {
		t.Log("waiting")
		time.Sleep(time.Minute)
	})
}

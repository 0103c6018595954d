package fails

import (
	"fmt"
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	fmt.Fprintln(os.Stderr, "main: clusters ready")
	os.Exit(m.Run())
}

func TestPlacement(t *testing.T) {
	t.Log("parent setup")
	t.Run("AGangFitsOneClique", func(t *testing.T) { t.Log("placed 8 of 8") })
	t.Run("ControllerKilledMidPlacement", func(t *testing.T) {
		t.Run("crash", func(t *testing.T) {
			t.Log("cluster logs in /tmp/x")
			t.Errorf("member 3 never bound")
		})
		t.Run("commit", func(t *testing.T) {})
	})
}

func TestFine(t *testing.T) {}

package controller

import (
	"testing"

	"github.com/spf13/pflag"
)

// Reservations are on unless --gang-reservations=false; an Options built in
// code (zero) has them on too.
func TestGangReservationsFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		no   bool
	}{
		{nil, false},
		{[]string{"--gang-reservations"}, false},
		{[]string{"--gang-reservations=true"}, false},
		{[]string{"--gang-reservations=false"}, true},
	} {
		var o Options
		fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
		o.AddFlags(fs)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if o.NoReservations != tc.no {
			t.Errorf("%v: NoReservations %v, want %v", tc.args, o.NoReservations, tc.no)
		}
	}
	var o Options
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	o.AddFlags(fs)
	if err := fs.Parse([]string{"--gang-reservations=maybe"}); err == nil {
		t.Error("--gang-reservations=maybe accepted")
	}
}

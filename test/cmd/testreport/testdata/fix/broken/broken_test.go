package broken

import "testing"

func TestX(t *testing.T) { undefined() }

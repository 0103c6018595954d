package component

import "testing"

func TestEnvFallsBackWhenUnsetOrEmpty(t *testing.T) {
	const key = "TESSERA_COMPONENT_ENV_TEST"
	if got := Env(key, "default"); got != "default" {
		t.Errorf("unset: %q, want the default", got)
	}
	t.Setenv(key, "")
	if got := Env(key, "default"); got != "default" {
		t.Errorf("empty: %q, want the default", got)
	}
	t.Setenv(key, "set")
	if got := Env(key, "default"); got != "set" {
		t.Errorf("set: %q, want the variable's value", got)
	}
}

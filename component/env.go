package component

import "os"

// Env is the value of the environment variable key, or def when it is unset
// or empty: a flag's default that a Deployment's env (the downward API, the
// chart's values) may set, as the flag itself still can.
func Env(key, def string) string {
	if v, ok := os.LookupEnv(key); ok && v != "" {
		return v
	}
	return def
}

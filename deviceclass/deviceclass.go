// Package deviceclass holds Tessera's DeviceClasses, the YAML an operator
// installs (the Helm chart renders the same files) and tests and the demo load.
package deviceclass

import (
	"embed"
	"fmt"
	"io/fs"
	"sort"

	resourceapi "k8s.io/api/resource/v1"
	"sigs.k8s.io/yaml"
)

//go:embed *.yaml
var files embed.FS

// Files returns the raw YAML of every class, by file name.
func Files() (map[string][]byte, error) {
	out := map[string][]byte{}
	err := fs.WalkDir(files, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := files.ReadFile(path)
		out[path] = data
		return err
	})
	return out, err
}

// All decodes every class, sorted by name.
func All() ([]*resourceapi.DeviceClass, error) {
	raw, err := Files()
	if err != nil {
		return nil, err
	}
	var out []*resourceapi.DeviceClass
	for name, data := range raw {
		var c resourceapi.DeviceClass
		if err := yaml.UnmarshalStrict(data, &c); err != nil {
			return nil, fmt.Errorf("device class file %s: %w", name, err)
		}
		out = append(out, &c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

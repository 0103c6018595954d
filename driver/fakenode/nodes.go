package fakenode

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
)

// fileNodes stand in for device nodes on a fake node: a regular file whose
// content names the node's numbers, so tests see what was made.
type fileNodes struct{}

func nodeContent(major, minor uint32) string { return fmt.Sprintf("c %d:%d\n", major, minor) }

func (fileNodes) Make(path string, major, minor uint32, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode.Perm())
	if err != nil {
		return fmt.Errorf("make fake device node %s: %w", path, err)
	}
	_, err = f.WriteString(nodeContent(major, minor))
	return errors.Join(err, f.Close())
}

func (fileNodes) Is(path string, major, minor uint32) (bool, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return string(data) == nodeContent(major, minor), nil
}

// Command ociimage builds Tessera's image without a container engine
// (test/ociimage), as an OCI archive that `ctr images import` or any OCI
// tool loads, and beside it the pause and busybox images of the test
// cluster's real-runtime nodes:
//
//	go run ./test/cmd/ociimage -o _output/images -image ghcr.io/tessera-dev/tessera:dev
//
// It reads the Debian packages from the cache that `make cluster-bins`
// fills and downloads nothing.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/tessera-dev/tessera/test/ociimage"
)

func main() {
	out := flag.String("o", "_output/images", "directory for the archives")
	image := flag.String("image", "ghcr.io/tessera-dev/tessera:dev", "name of Tessera's image")
	flag.Parse()
	if err := run(context.Background(), *out, *image); err != nil {
		fmt.Fprintf(os.Stderr, "ociimage: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, out, image string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "ociimage-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(work) }()
	archives, err := ociimage.BuildAll(ctx, ".", work, ociimage.DebDir(), image)
	if err != nil {
		return err
	}
	for name, img := range archives {
		file := filepath.Join(out, name)
		if err := ociimage.WriteArchive(file, img); err != nil {
			return fmt.Errorf("write %s: %w", file, err)
		}
		fmt.Println(file)
	}
	return nil
}

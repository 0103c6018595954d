package cdihook

import (
	"errors"
	"fmt"
	"io"

	"github.com/spf13/pflag"
)

// Main runs tessera-cdi-hook's command line (args without the program's
// name): "update-ldcache --link=PATH=TARGET... --library=PATH..." with the
// OCI state on state, or "install DEST".
func Main(args []string, state io.Reader) error {
	if len(args) == 0 {
		return errors.New("usage: tessera-cdi-hook update-ldcache [--link=/path=target]... [--library=/path]... | install DEST")
	}
	switch args[0] {
	case "install":
		if len(args) != 2 {
			return errors.New("usage: tessera-cdi-hook install DEST")
		}
		return Install(args[1])
	case "update-ldcache":
		fs := pflag.NewFlagSet("update-ldcache", pflag.ContinueOnError)
		links := fs.StringArray("link", nil, "Symlink to create in the container where nothing is: /container/path=target.")
		libs := fs.StringArray("library", nil, "Library (container path) to add to the container's loader cache under its file name.")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		r := Request{Libraries: *libs}
		for _, l := range *links {
			link, err := ParseLink(l)
			if err != nil {
				return err
			}
			r.Links = append(r.Links, link)
		}
		root, err := RootFS(state)
		if err != nil {
			return err
		}
		return Apply(root, r)
	}
	return fmt.Errorf("unknown command %q: want update-ldcache or install", args[0])
}

package plugin

import (
	"fmt"
	"os"

	"go.etcd.io/etcd/client/pkg/v3/fileutil"
)

// serializeLockFile is the file kubeletplugin locks around every gRPC call
// when rolling updates are on; the plugin takes the same lock for work it
// does outside calls (recovery at start, the stale-claim sweep).
const serializeLockFile = "serialize.lock"

// sharedState is the node's prepared state shared by two plugin instances
// during a rolling update. A nil *sharedState means one instance owns it.
type sharedState struct {
	lockPath string
}

// lock takes the cross-instance lock; a nil receiver locks nothing.
func (s *sharedState) lock() (func(), error) {
	if s == nil {
		return func() {}, nil
	}
	f, err := fileutil.LockFile(s.lockPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", s.lockPath, err)
	}
	return func() { _ = f.Close() }, nil
}

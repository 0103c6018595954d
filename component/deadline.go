package component

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"time"
)

// Deadline bounds every request of an API client (rest.Config.Wrap), so
// that an API server that accepts a request and never answers fails the
// call instead of hanging it: a request must be answered whole within
// timeout; a watch must be answered (its response headers) within timeout,
// and then streams as long as the server keeps it open (client-go's
// reflectors ask for 5 to 10 minutes).
//
// Why not rest.Config.Timeout: it bounds a watch's whole stream, so every
// informer's watch would end and be re-established each timeout, and it
// sends the timeout to the server with every request. Why not a context
// deadline at each call: most calls are made by client-go and
// kubeletplugin (informers, the ResourceSlice controller, leader election,
// the claims a prepare reads), out of our reach.
func Deadline(timeout time.Duration) func(http.RoundTripper) http.RoundTripper {
	return func(next http.RoundTripper) http.RoundTripper {
		return &deadlineTransport{next: next, timeout: timeout}
	}
}

type deadlineTransport struct {
	next    http.RoundTripper
	timeout time.Duration
}

func (t *deadlineTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx, cancel := context.WithCancel(req.Context())
	expired := &atomic.Bool{}
	timer := time.AfterFunc(t.timeout, func() {
		expired.Store(true)
		cancel()
	})
	resp, err := t.next.RoundTrip(req.WithContext(ctx))
	if err != nil {
		timer.Stop()
		cancel()
		return nil, t.explain(err, expired)
	}
	if req.URL.Query().Get("watch") == "true" {
		timer.Stop()
	}
	resp.Body = &deadlineBody{ReadCloser: resp.Body, t: t, expired: expired, stop: func() {
		timer.Stop()
		cancel()
	}}
	return resp, nil
}

// explain names the deadline in an error it caused.
func (t *deadlineTransport) explain(err error, expired *atomic.Bool) error {
	if err == nil || errors.Is(err, io.EOF) || !expired.Load() {
		return err
	}
	return fmt.Errorf("%w: the API server did not answer within %v", err, t.timeout)
}

// deadlineBody ends the request's deadline when the body is closed.
type deadlineBody struct {
	io.ReadCloser
	t       *deadlineTransport
	expired *atomic.Bool
	stop    func()
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	return n, b.t.explain(err, b.expired)
}

func (b *deadlineBody) Close() error {
	err := b.ReadCloser.Close()
	b.stop()
	return err
}

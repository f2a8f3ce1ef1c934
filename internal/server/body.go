package server

import (
	"errors"
	"io"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/openai"
)

// initialBodyBuffer is the most readBody allocates before bytes arrive: a Content-Length is a
// client's claim, not memory to hand out.
const initialBodyBuffer = 64 << 10

// readBody reads the whole body once, bounded in size by the configured limit and in time by
// the stalled-client timeout (between reads) and the request deadline (in all). Its buffer grows
// with the bytes that arrived, never ahead of them. A drain cuts bodies still arriving: those
// requests were not admitted yet and are answered 503.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, *openai.Error) {
	if r.ContentLength > s.cfg.MaxPayloadSize {
		return nil, tooLarge(s.cfg.MaxPayloadSize)
	}
	size := 512
	if r.ContentLength > 0 {
		size = int(min(r.ContentLength+1, initialBodyBuffer)) // +1 so the final Read sees EOF without growing
	}
	buf := make([]byte, 0, size)
	body := &stallReader{r: http.MaxBytesReader(w, r.Body, s.cfg.MaxPayloadSize), stall: time.Duration(s.cfg.StalledClientTimeoutSecs) * time.Second}
	if deadline, ok := r.Context().Deadline(); ok {
		body.deadline = deadline
	}
	if r.ContentLength != 0 { // a body-less request already has net/http reading its connection
		body.rc = http.NewResponseController(w)
		if !s.uploads.add(body) {
			return nil, drainingError()
		}
		defer s.uploads.remove(body)
		defer body.done()
	}
	for {
		if len(buf) == cap(buf) {
			next := 2 * cap(buf)
			if r.ContentLength > 0 {
				next = int(min(int64(next), r.ContentLength+1))
			}
			buf = slices.Grow(buf, next-len(buf))
		}
		n, err := body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			return nil, bodyError(err, body.cut.Load(), s.cfg.MaxPayloadSize)
		}
	}
}

func bodyError(err error, cut bool, limit int64) *openai.Error {
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return tooLarge(limit)
	case cut:
		return drainingError()
	case errors.Is(err, os.ErrDeadlineExceeded):
		return &openai.Error{Status: http.StatusRequestTimeout, Code: openai.CodeClientTimeout,
			Message: "the request body did not arrive in time (stalled_client_timeout_secs between bytes, request_timeout_secs in all)"}
	}
	return &openai.Error{Status: http.StatusBadRequest, Code: "body_read_failed", Message: "reading request body: " + err.Error()}
}

func drainingError() *openai.Error {
	return &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeDraining, Message: "shutting down: send the request again elsewhere"}
}

// stallReader keeps the connection's read deadline at min(last progress+stall, request
// deadline) while a request body is read, and clears it when done: net/http reads the idle
// connection afterwards to notice a client leaving, and a deadline there would cut the answer.
type stallReader struct {
	r        io.Reader
	rc       *http.ResponseController // nil: no deadlines
	stall    time.Duration
	deadline time.Time
	armed    time.Time
	cut      atomic.Bool // the drain ended this read
}

func (b *stallReader) Read(p []byte) (int, error) {
	if b.rc != nil {
		if now := time.Now(); now.Sub(b.armed) >= b.stall/8 {
			b.armed = now
			d := now.Add(b.stall)
			if !b.deadline.IsZero() {
				d = earlier(d, b.deadline)
			}
			_ = b.rc.SetReadDeadline(d)
			if b.cut.Load() { // a drain cut it while the deadline moved: cut it again
				_ = b.rc.SetReadDeadline(now)
			}
		}
	}
	return b.r.Read(p)
}

func (b *stallReader) done() { _ = b.rc.SetReadDeadline(time.Time{}) }

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// uploads are the request bodies being read, so that a drain can end them: a client that keeps
// a body open must not hold the shutdown for the grace period.
type uploads struct {
	mu       sync.Mutex
	m        map[*stallReader]struct{}
	draining bool
}

// add registers b, or reports false when the server is draining.
func (u *uploads) add(b *stallReader) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.draining {
		return false
	}
	if u.m == nil {
		u.m = map[*stallReader]struct{}{}
	}
	u.m[b] = struct{}{}
	return true
}

func (u *uploads) remove(b *stallReader) {
	u.mu.Lock()
	delete(u.m, b)
	u.mu.Unlock()
}

// cut ends every body read in progress and refuses new ones.
func (u *uploads) cut() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.draining = true
	for b := range u.m {
		b.cut.Store(true)
		_ = b.rc.SetReadDeadline(time.Now())
	}
}

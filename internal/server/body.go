package server

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/openai"
)

// initialBodyBuffer is the most readBody allocates before bytes arrive: a Content-Length is a
// client's claim, not memory to hand out.
const initialBodyBuffer = 128 << 10

// bodyBudget bounds the request body bytes the process holds at once, over every request: a
// body reserves its buffer's growth before it is allocated, and gives it back when its request
// ends. Past the limit the body is refused before more of it is read.
type bodyBudget struct {
	limit int64 // 0: no bound
	used  atomic.Int64
}

// take reserves n bytes, or reports false when they do not fit.
func (b *bodyBudget) take(n int64) bool {
	if b.limit <= 0 {
		return true
	}
	if b.used.Add(n) > b.limit {
		b.used.Add(-n)
		return false
	}
	return true
}

func (b *bodyBudget) give(n int64) { b.used.Add(-n) }

// errBodyBudget is a body refused because the bodies held at once would pass their bound.
var errBodyBudget = errors.New("request bodies held at once would exceed max_buffered_body_bytes")

// readBody reads the whole body once, bounded in size by the configured limit, in time by the
// stalled-client timeout (between reads), the body timeout and the request deadline (in all),
// and in memory by the process-wide budget (its bytes are held until release is called, once
// the request ended). A drain cuts bodies still arriving: those requests were not admitted yet
// and are answered 503.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) (body []byte, release func(), oerr *openai.Error) {
	release = func() {}
	defer func() {
		if oerr != nil {
			// The rest of the body is unread: the connection ends with the answer. net/http
			// would otherwise read what is left before answering, with no deadline — a client
			// that trickles its body would hold the connection and its handler for good.
			w.Header().Set("Connection", "close")
		}
	}()
	if r.ContentLength > s.opts.MaxPayloadSize {
		return nil, release, tooLarge(s.opts.MaxPayloadSize)
	}
	var sr *stallReader
	if sw := observed(w); sw != nil {
		sr = &sw.body
		sr.rc = sw.rc
	} else {
		sr = &stallReader{rc: http.NewResponseController(w)}
	}
	sr.r, sr.stall = http.MaxBytesReader(w, r.Body, s.opts.MaxPayloadSize), s.opts.StalledClientTimeout
	sr.deadline = time.Now().Add(s.opts.BodyTimeout)
	if deadline, ok := r.Context().Deadline(); ok && (s.opts.BodyTimeout <= 0 || deadline.Before(sr.deadline)) {
		sr.deadline = deadline
	}
	if r.ContentLength != 0 { // a body-less request already has net/http reading its connection
		sr.progress.Store(time.Now().UnixNano())
		if !s.uploads.add(sr) {
			return nil, release, drainingError()
		}
		defer s.uploads.remove(sr)
	}
	var held int64
	release = func() { s.bodies.give(held) }
	buf, err := readAll(sr, r.ContentLength, func(n int) bool {
		if !s.bodies.take(int64(n)) {
			return false
		}
		held += int64(n)
		return true
	})
	if err != nil {
		release()
		if errors.Is(err, errBodyBudget) {
			s.metrics.Rejections.WithLabelValues("body_budget").Inc()
		}
		return nil, func() {}, bodyError(err, sr.cut.Load(), s.opts.MaxPayloadSize)
	}
	return buf, release, nil
}

// scratchPool holds the first buffers of large bodies.
var scratchPool = sync.Pool{New: func() any { b := make([]byte, initialBodyBuffer); return &b }}

// readAll reads r to its end. A Content-Length is a client's claim, not memory to hand out: a
// claim up to initialBodyBuffer is allocated at once; a larger one starts in a pooled buffer and
// grows at most to twice what arrived, up to the claim, so memory follows the bytes received.
// reserve is asked for each buffer's bytes before it is taken (false: errBodyBudget), and given
// a buffer's bytes back (a negative count) once it was copied out of.
func readAll(r io.Reader, claimed int64, reserve func(n int) bool) ([]byte, error) {
	var buf []byte
	pooled := false // buf is the pooled buffer
	switch {
	case claimed > initialBodyBuffer:
		if !reserve(initialBodyBuffer) {
			return nil, errBodyBudget
		}
		scratch := scratchPool.Get().(*[]byte)
		defer scratchPool.Put(scratch)
		buf, pooled = (*scratch)[:0], true
	case claimed > 0:
		if !reserve(int(claimed + 1)) {
			return nil, errBodyBudget
		}
		buf = make([]byte, 0, claimed+1) // +1 so the final Read sees EOF without growing
	default:
		if !reserve(512) {
			return nil, errBodyBudget
		}
		buf = make([]byte, 0, 512)
	}
	for {
		if len(buf) == cap(buf) {
			next := 2 * cap(buf)
			if claimed > 0 {
				next = int(min(int64(next), claimed+1))
			}
			next = max(next, len(buf)+1)
			// Both buffers are live while one is copied into the other: the new one is reserved
			// whole, the old one given back once copied.
			if !reserve(next) {
				return nil, errBodyBudget
			}
			old := cap(buf)
			buf, pooled = append(make([]byte, 0, next), buf...), false
			reserve(-old)
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			if pooled { // short of the claim: copy out of the pool
				return append([]byte{}, buf...), nil
			}
			return buf, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

func bodyError(err error, cut bool, limit int64) *openai.Error {
	var mbe *http.MaxBytesError
	switch {
	case errors.Is(err, errBodyBudget):
		return &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeOverloaded, RetryAfter: "1",
			Message: "Baton holds as many request bodies as max_buffered_body_bytes allows: send the request again shortly"}
	case errors.As(err, &mbe):
		return tooLarge(limit)
	case cut:
		return drainingError()
	case errors.Is(err, os.ErrDeadlineExceeded):
		return &openai.Error{Status: http.StatusRequestTimeout, Code: openai.CodeClientTimeout,
			Message: "the request body did not arrive in time (stalled_client_timeout_secs between bytes, body_timeout_secs in all)"}
	}
	return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeBodyReadFailed, Message: "reading request body: " + err.Error()}
}

func drainingError() *openai.Error {
	return &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeDraining, Message: "shutting down: send the request again elsewhere"}
}

// stallReader records a request body's progress, so that the uploads sweeper can end a read
// that makes none for the stall timeout, or outlives the request deadline. The connection's
// read deadline is touched only then: moving it on every request costs microseconds in the
// runtime's poller, and so would a timer per request.
type stallReader struct {
	r        io.Reader
	rc       *http.ResponseController
	stall    time.Duration
	deadline time.Time    // the request deadline; zero: none
	progress atomic.Int64 // unix nanoseconds of the last bytes read

	mu       sync.Mutex
	finished bool        // the read is over: the connection is no longer the body's
	fired    bool        // the read deadline was moved to end the read
	cut      atomic.Bool // a drain ended the read
}

func (b *stallReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if n > 0 {
		b.progress.Store(time.Now().UnixNano())
	}
	return n, err
}

// overdue reports whether the read made no progress for the stall timeout or the request
// deadline passed.
func (b *stallReader) overdue(now time.Time) bool {
	return now.UnixNano()-b.progress.Load() >= int64(b.stall) || (!b.deadline.IsZero() && !now.Before(b.deadline))
}

// expire ends the read in progress by moving the connection's read deadline to now.
func (b *stallReader) expire(drain bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.finished {
		return
	}
	if drain {
		b.cut.Store(true)
	}
	b.fired = true
	_ = b.rc.SetReadDeadline(time.Now())
}

// finish marks the read over. If it was ended by a deadline, the deadline is cleared: net/http
// reads the idle connection afterwards to notice a client leaving, and a deadline there would
// cut the answer.
func (b *stallReader) finish() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.finished = true
	if b.fired {
		_ = b.rc.SetReadDeadline(time.Time{})
	}
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// uploads are the request bodies being read. A sweeper ends those that stall or outlive their
// deadline, and a drain ends them all: a client that keeps a body open must hold neither a
// handler nor the shutdown.
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
	b.finish()
}

// sweep ends the reads that are overdue at now.
func (u *uploads) sweep(now time.Time) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for b := range u.m {
		if b.overdue(now) {
			b.expire(false)
		}
	}
}

// cut ends every body read in progress and refuses new ones.
func (u *uploads) cut() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.draining = true
	for b := range u.m {
		b.expire(true)
	}
}

// sweepEvery is how often the sweeper looks: an eighth of the stall timeout, at most a second.
func sweepEvery(stall time.Duration) time.Duration { return min(stall/8, time.Second) }

// Start runs the background work of the server until ctx ends: the sweeper that ends stalled
// request bodies. Wait waits for it.
func (s *Server) Start(ctx context.Context) {
	s.d.Start(ctx)
	s.bg.Go(func() { s.warnUnservable(ctx) })
	every := sweepEvery(s.opts.StalledClientTimeout)
	s.bg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-t.C:
				s.uploads.sweep(now)
			}
		}
	})
}

// Wait waits for the background work Start began.
func (s *Server) Wait() { s.bg.Wait(); s.d.Wait() }

// WarnUnservable logs msg in a WARN with the models no request could be sent for now, each with
// why, when there are any (at startup, once registrations settle; after a reload).
func (s *Server) WarnUnservable(msg string) {
	if _, missing := s.d.Readiness(); len(missing) > 0 {
		s.log.Warn(msg, "unservable", strings.Join(missing, "; "))
	}
}

// warnUnservable says once, in a WARN, which models the configuration or the engines name that
// no request could be sent for, once the workers' first registrations are settled (each
// registered, or a minute passed): a model named in the configuration that no engine serves, an
// alias to nothing, a role missing.
func (s *Server) warnUnservable(ctx context.Context) {
	deadline := time.Now().Add(time.Minute)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.d.Registry().Snapshot().Pending() == 0 || time.Now().After(deadline) {
			s.WarnUnservable("models that no request can be sent for (the gateway stays ready while any model can be served)")
			return
		}
	}
}

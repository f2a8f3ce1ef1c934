// Package proxy forwards one request to one worker and relays the answer: the client's bytes
// out, the worker's status, headers and body back, SSE flushed as it arrives.
package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

var (
	// ErrClientGone means the client went away; nothing more can be written.
	ErrClientGone = errors.New("client disconnected")
	// ErrAbort means the upstream failed after the first byte reached the client: the handler
	// must abort the client connection (panic(http.ErrAbortHandler)) so the client sees a broken
	// response, never a silently truncated one.
	ErrAbort = errors.New("upstream failed after the first byte")
)

// NewTransport returns the pooled upstream transport Baton uses for every worker. Compression
// is left to the engines and clients: Baton never asks for it, so bodies pass through untouched.
func NewTransport() *http.Transport {
	return &http.Transport{
		Proxy: nil,
		DialContext: (&net.Dialer{
			Timeout:   10 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConns:          0,
		MaxIdleConnsPerHost:   512,
		IdleConnTimeout:       90 * time.Second,
		DisableCompression:    true,
		ExpectContinueTimeout: 0,
		WriteBufferSize:       64 << 10,
		ReadBufferSize:        64 << 10,
	}
}

// Proxy forwards requests to workers.
type Proxy struct {
	// Transport sends upstream requests.
	Transport http.RoundTripper
	// Timeout bounds one upstream request from send to the end of its body.
	Timeout time.Duration
	// Metrics records upstream errors; nil records nothing.
	Metrics *metrics.Metrics
	// Log receives upstream failures.
	Log *slog.Logger
}

// forwardHeaders are the only client headers sent to workers (besides Content-Type).
var forwardHeaders = []string{"Authorization", openai.HeaderRequestID, openai.HeaderTraceparent, openai.HeaderTracestate}

// hopHeaders are never relayed in either direction.
var hopHeaders = []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// Forward POSTs body to path on w and relays the response to rw. It returns nil when the whole
// response reached the client, ErrClientGone, ErrAbort (the caller must abort the connection), or
// an *openai.Error written to the client already.
func (p *Proxy) Forward(rw http.ResponseWriter, r *http.Request, w *worker.Worker, path string, body []byte) error {
	ctx, cancel := context.WithTimeout(r.Context(), p.Timeout)
	defer cancel()
	out, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL+path, bytes.NewReader(body))
	if err != nil {
		e := &openai.Error{Status: http.StatusInternalServerError, Code: "bad_upstream_url", Message: err.Error()}
		openai.WriteError(rw, e)
		return e
	}
	out.URL.RawQuery = r.URL.RawQuery
	CopyRequestHeaders(out.Header, r.Header, w)
	out.Header.Set("Content-Type", "application/json")
	out.ContentLength = int64(len(body))

	release := w.Acquire()
	defer release()
	resp, err := p.Transport.RoundTrip(out)
	if err != nil {
		return p.fail(rw, r, w, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		p.countError(w, metrics.KindStatus)
	}
	h := rw.Header()
	rid, via := h.Get(openai.HeaderRequestID), h.Get(openai.HeaderWorker)
	copyResponseHeaders(h, resp.Header)
	if rid != "" {
		h.Set(openai.HeaderRequestID, rid)
	}
	if via != "" {
		h.Set(openai.HeaderWorker, via)
	}
	rw.WriteHeader(resp.StatusCode)
	stream := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	if err := p.relay(rw, resp.Body, stream); err != nil {
		if r.Context().Err() != nil {
			return ErrClientGone
		}
		kind := metrics.KindMidStream
		if errors.Is(err, context.DeadlineExceeded) {
			kind = metrics.KindTimeout
		}
		p.countError(w, kind)
		p.Log.Warn("upstream failed mid-response; aborting the client connection", "worker", w.URL, "err", err)
		return ErrAbort
	}
	return nil
}

// relay copies the upstream body to the client. For SSE it flushes after every read, so each
// event leaves as soon as it arrives and nothing is re-buffered.
func (p *Proxy) relay(rw http.ResponseWriter, body io.Reader, stream bool) error {
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	rc := http.NewResponseController(rw)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if _, werr := rw.Write(buf[:n]); werr != nil {
				return fmt.Errorf("write to client: %w", werr)
			}
			if stream {
				if ferr := rc.Flush(); ferr != nil {
					return fmt.Errorf("flush to client: %w", ferr)
				}
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// fail maps an error before any response byte to the client's status and writes it.
func (p *Proxy) fail(rw http.ResponseWriter, r *http.Request, w *worker.Worker, err error) error {
	if r.Context().Err() != nil {
		return ErrClientGone
	}
	var e *openai.Error
	if errors.Is(err, context.DeadlineExceeded) {
		p.countError(w, metrics.KindTimeout)
		e = &openai.Error{Status: http.StatusGatewayTimeout, Code: openai.CodeUpstreamTimeout,
			Message: fmt.Sprintf("worker %s did not answer within %s", w.URL, p.Timeout)}
	} else {
		p.countError(w, metrics.KindTransport)
		e = &openai.Error{Status: http.StatusBadGateway, Code: openai.CodeUpstreamUnreachable,
			Message: fmt.Sprintf("worker %s: %v", w.URL, unwrapURLError(err))}
	}
	p.Log.Warn("upstream request failed", "worker", w.URL, "status", e.Status, "err", err)
	openai.WriteError(rw, e)
	return e
}

func (p *Proxy) countError(w *worker.Worker, kind string) {
	if p.Metrics != nil {
		p.Metrics.UpstreamErrors.WithLabelValues(w.URL, kind).Inc()
	}
}

func unwrapURLError(err error) error {
	var ue interface{ Unwrap() error }
	if errors.As(err, &ue) && ue.Unwrap() != nil {
		return ue.Unwrap()
	}
	return err
}

// CopyRequestHeaders copies the allowlisted client headers to an upstream request. The worker's
// own API key, when it has one, replaces the client's authorization.
func CopyRequestHeaders(dst, src http.Header, w *worker.Worker) {
	for _, k := range forwardHeaders {
		if v := src.Values(k); len(v) > 0 {
			dst[k] = v
		}
	}
	if w.APIKey != "" {
		dst.Set("Authorization", "Bearer "+w.APIKey)
	}
}

func copyResponseHeaders(dst, src http.Header) {
	for k, v := range src {
		dst[k] = v
	}
	for _, f := range src.Values("Connection") {
		for _, k := range strings.Split(f, ",") {
			dst.Del(strings.TrimSpace(k))
		}
	}
	for _, k := range hopHeaders {
		dst.Del(k)
	}
	if cl := src.Get("Content-Length"); cl != "" {
		if _, err := strconv.ParseInt(cl, 10, 64); err != nil {
			dst.Del("Content-Length")
		}
	}
}

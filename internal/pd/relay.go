package pd

import (
	"fmt"
	"io"
	"net/http"
	"strconv"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// Relay helpers shared by both strategies: the decode's answer to the client, and a failed
// leg's answer as the client's error.

func isStream(resp *http.Response) bool {
	return openai.IsEventStream(resp.Header.Get("Content-Type"))
}

// relayBody answers with the decode's whole non-streamed body passed through transform, and
// notes the answer's usage on rec.
func relayBody(rec *record.Record, rw http.ResponseWriter, dresp *http.Response, transform func([]byte) []byte) error {
	body, err := proxy.ReadBody(dresp.Body, dresp.ContentLength)
	if err != nil {
		return &proxy.ReadError{Err: err}
	}
	out := transform(body)
	if dresp.StatusCode == http.StatusOK {
		proxy.NoteUsage(rec, out)
	}
	h := rw.Header()
	proxy.CopyResponseHeaders(h, dresp.Header)
	h.Set("Content-Length", strconv.Itoa(len(out)))
	rw.WriteHeader(dresp.StatusCode)
	if _, err := rw.Write(out); err != nil {
		return proxy.ErrClientGone
	}
	return nil
}

// firstByte calls at once, when the first body bytes are read.
type firstByte struct {
	io.ReadCloser
	at   func()
	done bool
}

func (f *firstByte) Read(p []byte) (int, error) {
	n, err := f.ReadCloser.Read(p)
	f.saw(n)
	return n, err
}

func (f *firstByte) saw(n int) {
	if n > 0 && !f.done {
		f.done = true
		f.at()
	}
}

// firstByteView is firstByte over a body that lends views of its buffer (Baton's upstream
// client): it lends them on, so that the relay's per-stream fast path — no buffer held while
// a stream waits for its next event — reaches PD streams too.
type firstByteView struct {
	firstByte
	v interface{ Next() ([]byte, error) }
}

func (f *firstByteView) Next() ([]byte, error) {
	b, err := f.v.Next()
	f.saw(len(b))
	return b, err
}

// onFirstByte wraps body so that at is called once, at its first bytes.
func onFirstByte(body io.ReadCloser, at func()) io.ReadCloser {
	if v, ok := body.(interface{ Next() ([]byte, error) }); ok {
		return &firstByteView{firstByte: firstByte{ReadCloser: body, at: at}, v: v}
	}
	return &firstByte{ReadCloser: body, at: at}
}

// upstreamError is the failure of a leg that answered non-2xx: judged by the leg's status, and
// answered with that exact status, the engine's message, and a code naming the leg.
func upstreamError(leg string, w *worker.Worker, status int, header http.Header, body []byte) *outcome.Failure {
	if proxy.KeyRefusedBy(w, status) {
		return proxy.KeyRefusedFailure(leg, w, status)
	}
	e := &openai.Error{Status: status, Code: leg + "_" + openai.CodeUpstreamError,
		Message: fmt.Sprintf("%s worker %s answered %d: %s", leg, w.URL, status, openai.EngineMessage(body))}
	if header != nil {
		e.RetryAfter = header.Get("Retry-After")
	}
	return &outcome.Failure{Leg: leg, Worker: w.URL, Status: status, Answer: e}
}

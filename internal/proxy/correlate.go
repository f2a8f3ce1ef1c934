package proxy

import (
	"bytes"
	"errors"
	"io"
	"net/http"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

// ErrAnotherAnswer is an answer that is not the request's: named after another request's id
// than the one Baton sent (in its X-Request-Id, or in its id), or without the id its engine puts
// on every answer — an answer out of step on a reused connection (an engine, or something
// before it, that sent a request's answer twice or late). It is closed with its connection and
// never relayed: a failure of the worker's, retried before the client got a byte.
var ErrAnotherAnswer = errors.New("the worker's answer is not this request's (named after another request, or missing the id its engine names every answer with); the connection is closed")

// correlate proves an answer is its request's before a byte of it is relayed, where the worker's
// engine names its answers after the X-Request-Id Baton sent:
//
//   - in the answer's X-Request-Id (vLLM's --enable-request-id-headers): an engine once seen
//     echoing the id must echo this request's, and an answer naming another, or none, is closed
//     before its end — its connection with it, so that nothing that follows on it reaches another
//     request — and is ErrAnotherAnswer;
//   - else in the answer's id (vLLM's chatcmpl-<id> and cmpl-<id>): an engine once seen doing so
//     must name this answer after this request; the first bytes of a 200 are read for it before
//     the relay writes anything, and one named after another request ends the body with
//     ErrAnotherAnswer (a failure before the client's head: retried).
//
// A worker not seen doing either since it last registered (an engine that names answers its own
// way, or a proxy before it that sets its own id) is not judged: GET /workers says which are.
func (p *Proxy) correlate(out *http.Request, w *worker.Worker, resp *http.Response, err error) (*http.Response, error) {
	if err != nil {
		return resp, err
	}
	sent := out.Header.Get(openai.HeaderRequestID)
	if sent == "" {
		return resp, nil
	}
	got := resp.Header.Get(openai.HeaderRequestID)
	switch {
	case got == sent:
		w.NoteEcho()
		return resp, nil
	case w.Echoes():
		// A worker that echoes every answer's id gave this one another id, or none: bytes that
		// are no answer of its to this request (a duplicate, or stray bytes read as an answer).
		resp.Body.Close() // before its end: the connection is closed, never reused
		p.mismatch(w, sent, got)
		return nil, ErrAnotherAnswer
	case resp.StatusCode != http.StatusOK:
		return resp, nil
	}
	pr := &prover{ReadCloser: resp.Body, p: p, w: w, sent: sent}
	if v, ok := resp.Body.(viewer); ok {
		resp.Body = &provingViewer{prover: pr, v: v}
	} else {
		resp.Body = pr
	}
	return resp, nil
}

func (p *Proxy) mismatch(w *worker.Worker, sent, got string) {
	if p.Log != nil {
		p.Log.Error("an answer for another request arrived on a connection to the worker: closed, not relayed", "worker", w.URL, "sent_request_id", sent, "answer_request_id", got)
	}
}

// prover reads an answer's id in its first bytes (the relay's first read, before it writes).
type prover struct {
	io.ReadCloser
	p       *Proxy
	w       *worker.Worker
	sent    string
	checked bool
}

// check judges the answer by the id in its first bytes b.
func (r *prover) check(b []byte) error {
	r.checked = true
	id, ok := answerID(b)
	if !ok {
		return nil // no id where the engines put it: nothing to judge by
	}
	for _, prefix := range []string{"chatcmpl-", "cmpl-"} {
		if rest, found := bytes.CutPrefix(id, []byte(prefix)); found {
			if string(rest) == r.sent {
				r.w.NoteIDEcho()
				return nil
			}
			if r.w.IDEchoes() {
				r.ReadCloser.Close() // before its end: the connection is closed, never reused
				r.p.mismatch(r.w, r.sent, string(id))
				return ErrAnotherAnswer
			}
			return nil
		}
	}
	return nil
}

func (r *prover) Read(b []byte) (int, error) {
	n, err := r.ReadCloser.Read(b)
	if !r.checked && n > 0 {
		if cerr := r.check(b[:n]); cerr != nil {
			return 0, cerr
		}
	}
	return n, err
}

// provingViewer is a prover over a body that lends views of its read buffer (Baton's client).
type provingViewer struct {
	*prover
	v viewer
}

func (r *provingViewer) Next() ([]byte, error) {
	b, err := r.v.Next()
	if !r.checked && len(b) > 0 {
		if cerr := r.check(b); cerr != nil {
			return nil, cerr
		}
	}
	return b, err
}

// answerID finds the value of the first "id" key in the first bytes of an answer — a JSON
// object, or the first event of a stream ("data: {...") — where OpenAI-style engines put it
// first. ok is false when it is not there.
func answerID(b []byte) (id []byte, ok bool) {
	b = b[:min(len(b), 512)]
	b = bytes.TrimPrefix(bytes.TrimLeft(b, " \r\n"), []byte("data:"))
	b = bytes.TrimLeft(b, " ")
	rest, found := bytes.CutPrefix(b, []byte(`{"id":"`))
	if !found {
		rest, found = bytes.CutPrefix(b, []byte(`{"id": "`))
	}
	if !found {
		return nil, false
	}
	end := bytes.IndexByte(rest, '"')
	if end < 0 || bytes.IndexByte(rest[:end], '\\') >= 0 {
		return nil, false
	}
	return rest[:end], true
}

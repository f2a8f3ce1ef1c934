// Package dataplane plays a Gateway API data plane in front of an Endpoint Picker, as Envoy's
// ext_proc filter and original-destination routing do: for each HTTP request it opens an
// ext_proc stream, sends the headers and the body in chunks (full duplex streamed), applies the
// picker's header mutation, sends the request to the first endpoint of the picker's list that
// accepts a connection (the rest are the retries), reports the endpoint that served in the
// response path's metadata, and relays the response through the picker chunk by chunk.
//
// It is what Baton's tests and `baton bench --scenarios epp` put in front of `baton epp`: no
// Envoy binary can be had where they run.
package dataplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/baton-llm/baton/internal/epp"
)

// Proxy is the data plane: an http.Handler.
type Proxy struct {
	Picker extprocv3.ExternalProcessorClient
	Client *http.Client
	// ChunkSize is the size of the request body chunks sent to the picker (default 16 KiB, as
	// Envoy's buffers).
	ChunkSize int
	// Buffered sends the request body in one message after the headers' answer (BUFFERED)
	// instead of streaming it (FULL_DUPLEX_STREAMED).
	Buffered bool
	// Subset, when set, gives a request's subset hint (nil: none; empty: an empty one).
	Subset func(*http.Request) []string

	mu   sync.Mutex
	last Exchange
}

// Exchange is what the proxy saw of one request's pick.
type Exchange struct {
	Header, Metadata string // x-gateway-destination-endpoint in the header mutation and the dynamic metadata
	Prefiller        string // x-prefiller-host-port set by the picker
	Served           string // the endpoint that answered
	Tried            []string
	Immediate        int // the status of an immediate response; 0 when the picker picked
}

// Last is what the proxy saw of the latest request.
func (p *Proxy) Last() Exchange {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last
}

// ErrMismatch is a pick whose header and metadata differ: the protocol forbids it.
var ErrMismatch = errors.New("the destination header and metadata differ")

func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ex, err := p.serve(w, r)
	p.mu.Lock()
	p.last = ex
	p.mu.Unlock()
	if err != nil {
		http.Error(w, "data plane: "+err.Error(), http.StatusBadGateway)
	}
}

// serve runs one request; an error is answered 502 when nothing was written yet.
func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) (Exchange, error) {
	var ex Exchange
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	st, err := p.Picker.Process(ctx)
	if err != nil {
		return ex, err
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return ex, err
	}
	mode := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	if p.Buffered {
		mode = filterv3.ProcessingMode_BUFFERED
	}
	first := RequestHeaders(r.Method, r.Host, r.URL.RequestURI(), r.Header, len(body) == 0)
	first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
	if p.Subset != nil {
		if sub := p.Subset(r); sub != nil {
			vals := make([]*structpb.Value, len(sub))
			for i, e := range sub {
				vals[i] = structpb.NewStringValue(e)
			}
			first.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{epp.SubsetNamespace: {
				Fields: map[string]*structpb.Value{epp.SubsetKey: structpb.NewListValue(&structpb.ListValue{Values: vals})}}}}
		}
	}
	if err := st.Send(first); err != nil {
		return ex, err
	}
	if len(body) > 0 && !p.Buffered {
		if err := p.sendBody(st, body); err != nil {
			return ex, err
		}
	}
	// The request path's answers: headers (with the pick), then the body handed back.
	var mutation *extprocv3.HeaderMutation
	var sent bytes.Buffer
	for done := false; !done; {
		m, err := st.Recv()
		if err != nil {
			return ex, fmt.Errorf("picker: %w", err)
		}
		switch v := m.Response.(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			ir := v.ImmediateResponse
			ex.Immediate = int(ir.GetStatus().GetCode())
			for _, h := range ir.GetHeaders().GetSetHeaders() {
				w.Header().Set(h.GetHeader().GetKey(), string(h.GetHeader().GetRawValue()))
			}
			w.WriteHeader(ex.Immediate)
			_, _ = w.Write(ir.GetBody())
			return ex, nil
		case *extprocv3.ProcessingResponse_RequestHeaders:
			if mu := v.RequestHeaders.GetResponse().GetHeaderMutation(); mu != nil {
				mutation = mu
			}
			ex.Metadata = Destination(m)
			if len(body) == 0 {
				done = true
			} else if p.Buffered {
				if err := st.Send(RequestBody(body, true)); err != nil {
					return ex, err
				}
			}
		case *extprocv3.ProcessingResponse_RequestBody:
			c := v.RequestBody.GetResponse()
			if mu := c.GetHeaderMutation(); mu != nil { // buffered: the pick rides on the body's answer
				mutation = mu
				ex.Metadata = Destination(m)
			}
			switch bm := c.GetBodyMutation().GetMutation().(type) {
			case *extprocv3.BodyMutation_StreamedResponse:
				sent.Write(bm.StreamedResponse.GetBody())
				done = bm.StreamedResponse.GetEndOfStream()
			case *extprocv3.BodyMutation_Body:
				sent.Write(bm.Body)
				done = true
			default:
				if p.Buffered {
					sent.Write(body)
					done = true
				} else {
					return ex, errors.New("picker: a streamed body answer without the body")
				}
			}
		default:
			return ex, fmt.Errorf("picker: unexpected answer %T on the request path", v)
		}
	}
	if mutation == nil {
		return ex, errors.New("picker: no header mutation")
	}
	header := r.Header.Clone()
	for _, k := range mutation.GetRemoveHeaders() {
		header.Del(k)
	}
	for _, h := range mutation.GetSetHeaders() {
		header.Set(h.GetHeader().GetKey(), string(h.GetHeader().GetRawValue()))
	}
	ex.Header = header.Get(epp.HeaderDestination)
	ex.Prefiller = header.Get(epp.HeaderPrefiller)
	if ex.Header != ex.Metadata {
		return ex, fmt.Errorf("%w: %q, %q", ErrMismatch, ex.Header, ex.Metadata)
	}
	out := sent.Bytes()
	if len(body) > 0 && len(out) == 0 {
		out = body
	}
	// Down the list: the first endpoint that takes the connection serves.
	var resp *http.Response
	for _, ep := range strings.Split(ex.Header, ",") {
		ex.Tried = append(ex.Tried, ep)
		req, err := http.NewRequestWithContext(ctx, r.Method, "http://"+ep+r.URL.RequestURI(), bytes.NewReader(out))
		if err != nil {
			return ex, err
		}
		req.Header = header.Clone()
		req.Header.Set("Content-Length", strconv.Itoa(len(out)))
		req.ContentLength = int64(len(out))
		resp, err = p.Client.Do(req)
		if err == nil {
			ex.Served = ep
			break
		}
		var op *net.OpError
		if !errors.As(err, &op) || op.Op != "dial" {
			return ex, err
		}
	}
	if resp == nil {
		return ex, errors.New("no endpoint of the list accepted a connection")
	}
	defer resp.Body.Close()
	return ex, p.relay(st, w, resp, ex.Served)
}

// sendBody sends the body in chunks, the last with end of stream.
func (p *Proxy) sendBody(st extprocv3.ExternalProcessor_ProcessClient, body []byte) error {
	n := p.ChunkSize
	if n <= 0 {
		n = 16 << 10
	}
	for len(body) > 0 {
		c := min(n, len(body))
		if err := st.Send(RequestBody(body[:c], c == len(body))); err != nil {
			return err
		}
		body = body[c:]
	}
	return nil
}

// relay sends the response through the picker: headers with the served endpoint, then each
// body chunk, writing what the picker hands back to the client.
func (p *Proxy) relay(st extprocv3.ExternalProcessor_ProcessClient, w http.ResponseWriter, resp *http.Response, served string) error {
	if err := st.Send(ResponseHeaders(resp.StatusCode, resp.Header, served, false)); err != nil {
		return err
	}
	if _, err := st.Recv(); err != nil {
		return fmt.Errorf("picker, response headers: %w", err)
	}
	for k, vs := range resp.Header {
		if k != "Content-Length" {
			w.Header()[k] = vs
		}
	}
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		eos := rerr != nil
		if n > 0 || eos {
			if err := st.Send(ResponseBody(buf[:n], eos)); err != nil {
				return nil // the head went out: a broken picker cuts the response short
			}
			m, err := st.Recv()
			if err != nil {
				return nil
			}
			sr := m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if _, err := w.Write(sr.GetBody()); err != nil {
				return nil
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if eos {
			_ = st.CloseSend()
			return nil
		}
	}
}

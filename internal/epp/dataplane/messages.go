package dataplane

import (
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/baton-llm/baton/internal/epp"
)

// The ext_proc messages a data plane sends, as Envoy writes them: header names lower-cased,
// values in raw_value, pseudo-headers first.

// RequestHeaders is a request's headers (:authority when host is not ""); endOfStream says it
// has no body.
func RequestHeaders(method, host, path string, header http.Header, endOfStream bool) *extprocv3.ProcessingRequest {
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(method)}, {Key: ":path", RawValue: []byte(path)}, {Key: ":scheme", RawValue: []byte("http")}}}
	if host != "" {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: ":authority", RawValue: []byte(host)})
	}
	appendHeaders(hm, header)
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: hm, EndOfStream: endOfStream}}}
}

// RequestBody is a chunk of a request's body.
func RequestBody(b []byte, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: endOfStream}}}
}

// ResponseHeaders is a response's headers, with the endpoint that served it in the metadata
// (none when served is "").
func ResponseHeaders(status int, header http.Header, served string, endOfStream bool) *extprocv3.ProcessingRequest {
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(status))}}}
	appendHeaders(hm, header)
	m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: hm, EndOfStream: endOfStream}}}
	if served != "" {
		m.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{epp.MetadataNamespace: {
			Fields: map[string]*structpb.Value{epp.ServedKey: structpb.NewStringValue(served)}}}}
	}
	return m
}

// ResponseBody is a chunk of a response's body.
func ResponseBody(b []byte, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: b, EndOfStream: endOfStream}}}
}

// Destination is the pick in an answer's dynamic metadata ("" when absent).
func Destination(m *extprocv3.ProcessingResponse) string {
	return m.GetDynamicMetadata().GetFields()[epp.MetadataNamespace].GetStructValue().GetFields()[epp.HeaderDestination].GetStringValue()
}

func appendHeaders(hm *corev3.HeaderMap, header http.Header) {
	for k, vs := range header {
		for _, v := range vs {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
}

"""The image URL policy, on the address kinds and spellings an SSRF attempt uses."""

import ipaddress

import pytest

from orchestrator.errors import InvalidRequest
from orchestrator.media_policy import UrlPolicy, check_image_urls, internal_kind


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("10.1.2.3", "private"), ("172.16.0.1", "private"),
    ("192.168.1.1", "private"), ("fd00:ec2::254", "private"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"),
    ("8.8.8.8", None), ("2606:4700::1111", None),
    # IPv6 transition addresses are judged by the IPv4 they reach: 6to4, Teredo (server, client), NAT64
    ("2002:7f00:1::", "loopback"), ("2002:a9fe:a9fe::", "link-local"), ("2002:0a00:0001::", "private"),
    ("2002:808:808::", None), ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"), ("64:ff9b::7f00:1", "loopback"),
])
def test_internal_address_kinds(address, kind):
    assert internal_kind(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize("url", ["http://127.1/a.png", "http://2130706433/a.png", "http://0x7f000001/a.png",
                                 "http://[::ffff:127.0.0.1]/a.png", "http://localhost:8000/metrics",
                                 "https://169.254.169.254/", "http://[fe80::1]/a.png"])
async def test_every_spelling_of_an_internal_host_is_refused(url):
    with pytest.raises(InvalidRequest, match="not allowed: it resolves to a"):
        await check_image_urls([("messages[0].content[0]", url)], UrlPolicy())


async def test_credentials_are_refused_and_never_repeated():
    with pytest.raises(InvalidRequest) as info:
        await check_image_urls([("m", "https://admin:hunter2@93.184.216.34/a.png")], UrlPolicy())
    assert "hunter2" not in info.value.message and "credentials" in info.value.message


async def test_the_allowlist_takes_hosts_and_networks():
    policy = UrlPolicy.from_allowlist(["127.0.0.0/8", "images.internal"])
    await check_image_urls([("m", "http://127.0.0.1:9/a.png"), ("n", "http://images.internal/a.png")], policy)
    with pytest.raises(InvalidRequest, match="private"):
        await check_image_urls([("m", "http://10.0.0.1/a.png")], policy)


async def test_a_public_address_passes_and_an_unresolvable_host_is_refused():
    await check_image_urls([("m", "http://93.184.216.34/a.png"), ("n", "https://[2606:4700::1111]/a.png")], UrlPolicy())
    with pytest.raises(InvalidRequest, match="does not resolve"):
        await check_image_urls([("m", "http://no-such-host.invalid/a.png")], UrlPolicy(resolve_timeout_s=1.0))
